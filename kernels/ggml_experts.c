// A sparse MoE MLP over GGML block-format experts in one call (engine/model/moe.py's
// `SparseMoE.forward` on the fused CPU path; ggml_experts.py builds the arguments).
//
// moe_forward runs, for T tokens x (T, H) bf16 and E experts of which each token takes k:
//
//   router    logits = x @ router.T in fp32 (E, H), softmax, top k, renormalised to sum 1
//             when `norm_topk`; or the choices and weights given (`router` NULL)
//   groups    the T k (token, expert) choices sorted by expert, stably over the choices
//             taken slot by slot (moe.py's ExpertGroups: transformers' order)
//   gate_up   each chosen expert's gate_up product over its run of rows, rounded to bf16
//   gated     act(gate) * up per row by the fused glue's own function (cpu_ops.c's silu_mul,
//             called through a pointer, so the same code and the same bits)
//   down      each chosen expert's down product of those rows, rounded to bf16
//   sum       out[t] = bf16(sum over t's experts, ascending, of weight * down row) in fp32
//
// the same operations in the same order as moe.py's per-expert path, so the same bits for
// the same routing. The products are ggml_quants.c's (this file includes it: the same row
// kernels and activation quantization, built with the same flags per instruction set), so
// a row's result is the one ggml_linear gives. What the call saves over the per-expert
// path: the Python and torch glue between ~20 calls a layer, one OpenMP region a product
// (each a fork and a join), and the activation quantization repeated per expert. One
// OpenMP region runs the whole layer; its threads split the chosen experts' weight rows
// (units of 16 interleaved rows, or single rows) as one list, so every thread streams its
// share of every expert's bytes, with a barrier between the phases.

#include "ggml_quants.c"

typedef void (*gated_fn)(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t size,
                        int num_threads);

#define MAX_PARTS 2  // a gate_up of two block types (gate, up) is two parts
#define SMALL_STEP 2 // up to this many tokens route and quantize on one thread
#define SUM_PIECE 128 // columns of the weighted sum a work item

// One block-format part of a projection, per expert: `ptrs[e]` its rows (or groups of 16
// interleaved rows) `stride` bytes apart, `n_out` rows of `k` elements, written at column
// `col` of the projection's output.
typedef struct {
    const int64_t *ptrs;
    int64_t stride, n_out, col, k;
    int qtype, interleaved;
    BlockType bt;
    int64_t act_bytes, kp, units, rows_per_unit;
} Part;

static int part_init(Part *p) {
    if (!block_type(p->qtype, &p->bt) || p->k % p->bt.block_elems) return -1;
    if (p->interleaved && !(x16_type(p->qtype) && p->n_out % 16 == 0)) return -1;
    p->kp = (p->k + CHUNK_ELEMS - 1) / CHUNK_ELEMS * CHUNK_ELEMS;
#if AGENTRT_ISA >= 1
    p->act_bytes = q8k_type(p->qtype) ? act8k_bytes(p->k) : act_row_bytes(p->kp);
#else
    p->act_bytes = act_row_bytes(p->kp);
#endif
    p->rows_per_unit = p->interleaved ? 16 : 1;
    p->units = p->n_out / p->rows_per_unit;
    return 0;
}

static void quantize_for(const Part *p, const void *x, int x_bf16, uint8_t *out) {
#if AGENTRT_ISA >= 1
    if (q8k_type(p->qtype)) {
        quantize_row_q8k(x, x_bf16, p->k, out);
        return;
    }
#endif
    quantize_row(x, x_bf16, p->k, p->kp, act_row(out, p->kp, 0));
}

// One unit of weight rows `w` (a row, or 16 interleaved) against `tr` quantized activation
// rows `at` -> sums (tr x rows_per_unit): ggml_linear's loop body.
static void unit_sums(const Part *p, const uint8_t *w, const uint8_t *at, int64_t tr,
                      float *sums, Acc *acc) {
    const int qtype = p->qtype;
    const int64_t row_blocks = p->k / p->bt.block_elems;
#if AGENTRT_ISA >= 1
    if (p->interleaved) {
#if AGENTRT_ISA == 2
        if (qtype == T_Q4_K || qtype == T_Q6_K) {
            x16kq_group(qtype, w, row_blocks, at, p->k, tr, sums);
            return;
        }
#endif
        x16_group(qtype, w, row_blocks, at, p->kp, tr, sums);
        return;
    }
    if (fused_legacy(qtype)) {
        legacy_row(qtype, &p->bt, w, row_blocks, (uint8_t *)at, p->kp, tr, sums);
        return;
    }
    if (q8k_type(qtype)) {
        kquant_row(qtype, w, row_blocks, p->bt.block_bytes, at, p->k, tr, sums);
        return;
    }
#endif
    const int blocks_per_chunk = CHUNK_ELEMS / p->bt.block_elems;
    Chunk chunk;
    for (int64_t t = 0; t < tr; t++) acc[t] = acc_zero();
    for (int64_t b0 = 0; b0 < row_blocks; b0 += blocks_per_chunk) {
        const int nb =
            row_blocks - b0 < blocks_per_chunk ? (int)(row_blocks - b0) : blocks_per_chunk;
        decode_chunk(qtype, &p->bt, w + b0 * p->bt.block_bytes, nb, &chunk);
        const int64_t e0 = b0 * p->bt.block_elems, g0 = e0 / GROUP;
        for (int64_t t = 0; t < tr; t++) {
            const ActRow r = act_row((uint8_t *)at, p->kp, t);
            acc[t] = dot_chunk(&chunk, r.q + e0, r.d16 + g0, r.s16 + g0, acc[t]);
        }
    }
    for (int64_t t = 0; t < tr; t++) sums[t] = acc_sum(acc[t]);
}

// The work of one projection: every chosen expert's units of every part, as one list
// (expert-major) that the threads split statically. Item i -> (group, part, unit).
typedef struct {
    const Part *parts;
    int num_parts;
    int64_t units_per_group; // all parts' units of one expert
} Work;

static inline void work_item(const Work *wk, int64_t i, int64_t *g, int *p, int64_t *u) {
    *g = i / wk->units_per_group;
    int64_t r = i % wk->units_per_group;
    int q = 0;
    while (r >= wk->parts[q].units) r -= wk->parts[q++].units;
    *p = q;
    *u = r;
}

// Run the products of one projection: for each chosen expert (group g: rows start[g] ..
// start[g + 1] of `act[part]`, expert experts[g]) and each of its units, the group's rows
// in tiles of at most `tile` -> out (rows, out_width) bf16. Call inside the parallel
// region; ends with the work-shared loop's barrier.
static void run_products(const Work *wk, int64_t num_groups, const int64_t *experts,
                         const int64_t *start, uint8_t *const *act, uint16_t *out,
                         int64_t out_width, float *sums, Acc *acc, int64_t tile) {
    const int64_t items = num_groups * wk->units_per_group;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < items; i++) {
        if (!sums || !acc) continue; // the failure is marked; every thread meets the loop
        int64_t g, u;
        int pi;
        work_item(wk, i, &g, &pi, &u);
        const Part *p = &wk->parts[pi];
        const uint8_t *w = (const uint8_t *)p->ptrs[experts[g]] + u * p->stride;
        for (int64_t t0 = start[g]; t0 < start[g + 1]; t0 += tile) {
            const int64_t tr = start[g + 1] - t0 < tile ? start[g + 1] - t0 : tile;
            unit_sums(p, w, act[pi] + t0 * p->act_bytes, tr, sums, acc);
            const int64_t col = p->col + u * p->rows_per_unit;
            for (int64_t t = 0; t < tr; t++)
                for (int64_t r = 0; r < p->rows_per_unit; r++)
                    out[(t0 + t) * out_width + col + r] =
                        f32_to_bf16(sums[t * p->rows_per_unit + r]);
        }
    }
}

// Token t's routing from its router logits (E): softmax in fp32, the top k (ties: the lower
// expert first), renormalised when `norm_topk`.
static void route_token(const float *logits, int64_t num_experts, int64_t top_k, int norm_topk,
                        float *probs, float *weights, int64_t *chosen) {
    float m = logits[0];
    for (int64_t e = 1; e < num_experts; e++) m = logits[e] > m ? logits[e] : m;
    float total = 0.0f;
    for (int64_t e = 0; e < num_experts; e++) total += probs[e] = expf(logits[e] - m);
    for (int64_t e = 0; e < num_experts; e++) probs[e] /= total;
    float sum = 0.0f;
    for (int64_t j = 0; j < top_k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < num_experts; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j; i++) taken |= chosen[i] == e;
            if (!taken && (best < 0 || probs[e] > probs[best])) best = e;
        }
        chosen[j] = best;
        weights[j] = probs[best];
        sum += probs[best];
    }
    if (norm_topk)
        for (int64_t j = 0; j < top_k; j++) weights[j] /= sum;
}

// Rows r0 .. r1 of the sorted rows (token[r]'s x row) quantized for each gate_up part.
static void quantize_up(const Part *up, int num_up, const uint16_t *x, int64_t hidden,
                        const int64_t *token, int64_t r0, int64_t r1, uint8_t *const *act) {
    for (int64_t r = r0; r < r1; r++)
        for (int i = 0; i < num_up; i++)
            quantize_for(&up[i], x + token[r] * hidden, 1, act[i] + r * up[i].act_bytes);
}

// Router logit: x's bf16 row (H) . an fp32 router row.
static float router_dot(const uint16_t *x, const float *w, int64_t n) {
    float s = 0.0f;
    int64_t h = 0;
#if AGENTRT_ISA == 2
    __m512 v = _mm512_setzero_ps();
    for (; h + 16 <= n; h += 16) {
        const __m256i b = _mm256_loadu_si256((const __m256i *)(x + h));
        const __m512 xv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
        v = _mm512_fmadd_ps(xv, _mm512_loadu_ps(w + h), v);
    }
    s = _mm512_reduce_add_ps(v);
#endif
    for (; h < n; h++) s += bf16_to_f32(x[h]) * w[h];
    return s;
}

// The arguments, one int64 each (pointers as integers), in this order:
//   0 x (T, H) bf16          1 T        2 H        3 I (the experts' intermediate size)
//   4 E                      5 k        6 norm_topk
//   7 router (E, H) fp32, or 0: `weights` and `chosen` are given
//   8 weights (T, k) fp32    9 chosen (T, k) int64: written when routed here (0: not
//     wanted), read otherwise
//  10 out (T, H) bf16       11 gated_fn 12 num_threads
//  13 number of gate_up parts P (1 or 2), then per part 6 values, then the down part's 6:
//     ptrs (E int64), stride, n_out, col, qtype, interleaved
// Returns 0; -1 for a part this build cannot run or shapes that do not add up; -2 when
// memory runs out; -3 for an expert index out of range (given routing).
int moe_forward(const int64_t *a) {
    const uint16_t *x = (const uint16_t *)a[0];
    const int64_t num_tokens = a[1], hidden = a[2], inter = a[3], num_experts = a[4],
                  top_k = a[5];
    const int norm_topk = (int)a[6];
    const float *router = (const float *)a[7];
    float *weights = (float *)a[8];
    int64_t *chosen = (int64_t *)a[9];
    uint16_t *out = (uint16_t *)a[10];
    const gated_fn gated = (gated_fn)a[11];
    int num_threads = (int)a[12];
    const int num_up = (int)a[13];
    if (num_up < 1 || num_up > MAX_PARTS || top_k < 1 || top_k > num_experts) return -1;
    Part up[MAX_PARTS], down;
    int64_t up_width = 0;
    for (int i = 0; i <= num_up; i++) {
        const int64_t *f = a + 14 + 6 * i;
        Part *p = i < num_up ? &up[i] : &down;
        *p = (Part){.ptrs = (const int64_t *)f[0], .stride = f[1], .n_out = f[2], .col = f[3],
                    .k = i < num_up ? hidden : inter, .qtype = (int)f[4],
                    .interleaved = (int)f[5]};
        if (part_init(p)) return -1;
        if (i < num_up) up_width += p->n_out;
    }
    if (up_width != 2 * inter || down.n_out != hidden || down.col != 0) return -1;
    const int64_t rows = num_tokens * top_k;
    if (!router && (!weights || !chosen)) return -1;
    if (!router)
        for (int64_t r = 0; r < rows; r++)
            if (chosen[r] < 0 || chosen[r] >= num_experts) return -3;

    // Per-call buffers: the sorted rows' quantized activations per gate_up part and for
    // down, the bf16 gate_up / gated / down rows, and the groups.
    int64_t max_act = down.act_bytes;
    for (int i = 0; i < num_up; i++) max_act = up[i].act_bytes > max_act ? up[i].act_bytes : max_act;
    uint8_t *act_up[MAX_PARTS] = {0}, *act_down = NULL;
    const size_t act_total = (size_t)rows * ((size_t)num_up * max_act + down.act_bytes);
    uint8_t *act_mem = aligned_alloc(64, (act_total + 63) / 64 * 64);
    uint16_t *gate_up = malloc((size_t)rows * (2 * inter + inter + hidden) * 2);
    int64_t *idx = malloc((size_t)(3 * rows + 3 * num_experts + 1 + num_tokens) * sizeof(int64_t));
    float *scratch = malloc((size_t)(num_tokens * num_experts * 2 + 2 * rows) * sizeof(float));
    int failed = !act_mem || !gate_up || !idx || !scratch;
    if (failed) {
        free(act_mem), free(gate_up), free(idx), free(scratch);
        return -2;
    }
    for (int i = 0; i < num_up; i++) act_up[i] = act_mem + (size_t)i * rows * max_act;
    act_down = act_mem + (size_t)num_up * rows * max_act;
    uint16_t *gated_rows = gate_up + rows * 2 * inter, *down_rows = gated_rows + rows * inter;
    // token[r]: the token of sorted row r; by_token[t k + j]: token t's j-th sorted row (its
    // experts ascending); the groups: experts[g], start[g] (num_groups + 1 entries).
    int64_t *by_token = idx, *token = idx + rows, *count = idx + 2 * rows;
    int64_t *experts = count + num_experts, *start = experts + num_experts;
    int64_t *filled = start + num_experts + 1;
    if (!chosen) chosen = filled + num_tokens;
    float *logits = scratch, *probs = scratch + num_tokens * num_experts;
    float *row_weight = probs + num_tokens * num_experts;
    if (!weights) weights = row_weight + rows;
    int64_t num_groups = 0;

    Work uw = {up, num_up, 0};
    for (int i = 0; i < num_up; i++) uw.units_per_group += up[i].units;
    const Work down_work = {&down, 1, down.units};
    // Small work runs on the caller's thread (a fork costs more), as in ggml_linear.
    if (top_k * (2 * inter + hidden) * hidden < PARALLEL_WORK) num_threads = 1;

#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        const int64_t tile_rows = ACT_TILE_BYTES / max_act < 8 ? 8 : ACT_TILE_BYTES / max_act / 8 * 8;
        Acc *acc = aligned_alloc(64, ((tile_rows * sizeof(Acc) + 63) / 64) * 64);
        float *sums = malloc(tile_rows * 16 * sizeof(float));
        float *total = malloc(hidden * sizeof(float));
        if (!acc || !sums || !total) {
#pragma omp atomic write
            failed = 1;
        }
        // A decode's few router rows and quantized rows run in the `single` below: each
        // barrier saved matters most on a loaded machine (a thread waits on a descheduled one).
        const int split_router = router && num_tokens > SMALL_STEP;
        const int split_quantize = rows > SMALL_STEP * 8;
        if (split_router) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < num_tokens * num_experts; i++)
                logits[i] = router_dot(x + i / num_experts * hidden,
                                       router + i % num_experts * hidden, hidden);
        }
#pragma omp single
        {
            if (router && !split_router)
                for (int64_t i = 0; i < num_tokens * num_experts; i++)
                    logits[i] = router_dot(x + i / num_experts * hidden,
                                           router + i % num_experts * hidden, hidden);
            if (router)
                for (int64_t t = 0; t < num_tokens; t++)
                    route_token(logits + t * num_experts, num_experts, top_k, norm_topk,
                                probs + t * num_experts, weights + t * top_k,
                                chosen + t * top_k);
            // Counting sort of the slot-major choices by expert (stable).
            memset(count, 0, num_experts * sizeof(int64_t));
            for (int64_t r = 0; r < rows; r++) count[chosen[r]]++;
            int64_t at = 0;
            for (int64_t e = 0; e < num_experts; e++) {
                if (!count[e]) continue;
                experts[num_groups] = e;
                start[num_groups++] = at;
                const int64_t n = count[e];
                count[e] = at; // now the next free row of e
                at += n;
            }
            start[num_groups] = at;
            for (int64_t s = 0; s < top_k; s++)
                for (int64_t t = 0; t < num_tokens; t++) {
                    const int64_t r = count[chosen[t * top_k + s]]++;
                    token[r] = t;
                    row_weight[r] = weights[t * top_k + s];
                }
            memset(filled, 0, num_tokens * sizeof(int64_t));
            for (int64_t r = 0; r < rows; r++) by_token[token[r] * top_k + filled[token[r]]++] = r;
            if (!split_quantize) quantize_up(up, num_up, x, hidden, token, 0, rows, act_up);
        }
        // Quantize the sorted rows for each gate_up part (x rows repeat: each token's row
        // once per expert it chose).
        if (split_quantize) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++)
                quantize_up(up, num_up, x, hidden, token, r, r + 1, act_up);
        }
        run_products(&uw, num_groups, experts, start, act_up, gate_up, 2 * inter, sums, acc,
                     tile_rows);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            gated(gate_up + r * 2 * inter, gated_rows + r * inter, 1, inter, 1);
            quantize_for(&down, gated_rows + r * inter, 1, act_down + r * down.act_bytes);
        }
        uint8_t *act_d[1] = {act_down};
        run_products(&down_work, num_groups, experts, start, act_d, down_rows, hidden, sums,
                     acc, tile_rows);
        // out[t] = the sum over t's rows (expert ascending: `by_token`) of weight * down
        // row, in fp32 from 0 (moe.py's index_add_ in the groups' order); by pieces of
        // SUM_PIECE columns, so a decode's one token splits over the threads too.
        const int64_t pieces = (hidden + SUM_PIECE - 1) / SUM_PIECE;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < num_tokens * pieces; i++) {
            if (!total) continue;
            const int64_t t = i / pieces, h0 = i % pieces * SUM_PIECE;
            const int64_t h1 = h0 + SUM_PIECE < hidden ? h0 + SUM_PIECE : hidden;
            const int64_t *mine = by_token + t * top_k;
            for (int64_t h = h0; h < h1; h++) total[h] = 0.0f;
            for (int64_t j = 0; j < top_k; j++) {
                const uint16_t *d = down_rows + mine[j] * hidden;
                const float wj = row_weight[mine[j]];
                for (int64_t h = h0; h < h1; h++) total[h] += bf16_to_f32(d[h]) * wj;
            }
            for (int64_t h = h0; h < h1; h++) out[t * hidden + h] = f32_to_bf16(total[h]);
        }
        free(acc);
        free(sums);
        free(total);
    }
    free(act_mem), free(gate_up), free(idx), free(scratch);
    return failed ? -2 : 0;
}
