"""Weight loaders, one per format (vLLM's `model_loader` at this project's size).

    gguf_reader.py         the GGUF container: metadata values and the tensor table
    gguf_file.py           a GGUF file: tensors memory-mapped, config + tokenizer metadata
    gguf_tokenizer.py      a GGUF's tokenizer built from its fields (`tokenizers`, no transformers)
    fast_tokenizer.py      FastTokenizer: that tokenizer with its specials and chat template
    tokenizer.py           load_tokenizer: a GGUF's FastTokenizer, an HF directory's AutoTokenizer
    gguf_loader.py         GGUFLoader: tensors in their own block layout, sliced per rank
    safetensors_loader.py  SafetensorsLoader: HF safetensors in their own dtype, per rank
    weights.py             the model's parameters by name, their parts and splits
    quantization.py        which format each weight is held in (`quantization`)
    load.py                get_loader, load_weights: fill a meta-device model
    fit.py                 weights + KV pool checked against memory before allocating
    checkpoint.py          resolve_model: a local HF directory, a .gguf file or the embedded
                           default; its config.json; a whole state dict for tests

Nothing is imported here, so importing one loader module loads only what it needs.
"""
