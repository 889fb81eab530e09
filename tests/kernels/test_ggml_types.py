"""kernels/ggml_types.py restates gguf-py's type ids and block sizes (so that a load need not
import gguf-py): the two must agree."""

from __future__ import annotations

import gguf

from agentrt.kernels.ggml_linear import GGMLType as ExportedType
from agentrt.kernels.ggml_linear import block_shape
from agentrt.kernels.ggml_types import BLOCK_SIZES, GGMLType, type_name


def test_type_ids_and_block_sizes_are_gguf_pys() -> None:
    theirs = {t.name: int(t) for t in gguf.GGMLQuantizationType}
    assert {t.name: int(t) for t in GGMLType} == theirs
    assert {int(t): size for t, size in BLOCK_SIZES.items()} == {
        int(t): tuple(size) for t, size in gguf.GGML_QUANT_SIZES.items()
    }
    assert ExportedType is GGMLType  # the one home the engine imports
    assert block_shape(gguf.GGMLQuantizationType.Q6_K) == (256, 210)
    assert GGMLType.Q5_0 == gguf.GGMLQuantizationType.Q5_0  # ints alike


def test_type_name_of_a_known_and_an_unknown_id() -> None:
    assert type_name(12) == "Q4_K"
    assert type_name(33) == "unknown type 33"
