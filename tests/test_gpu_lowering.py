"""The served programs lower for the GPU from a CPU machine: every Pallas kernel of the plain and
the speculative step (int4, int8 and bf16 weights), the prefill chunk and the mixed iteration
goes through the Triton lowering, with Ling-3.0-flash's shapes and every SwiGLU limit combination
its layers use (routed and shared clamps, either or both), so a kernel that cannot lower fails
here rather than at a GPU server's start-up. Nothing is allocated but the slots: the weights are
abstract."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from ling import build
from ling.config import preset
from ling.quantize import Quantization
from spec.sampling import SamplingParams
from spec.step import new_slots
from spec.stepper import ChunkPrefiller, Stepper


FORMATS = {"int4": Quantization(4, experts=True, lm_head=True), "int8": Quantization(8, experts=True),
           "bf16": None}


def cut(fmt: str):
    # layers 0-1 dense, 2-4 KDA + MoE, 5 MLA + MoE; limits (routed, shared): (-, 5), (4, 5), (-, -), (4, 7)
    cfg = preset("ling-3-flash").first_layers(6)
    cfg = dataclasses.replace(cfg, expert_swiglu_limits=(None, None, None, 4.0, None, 4.0, None),
                              shared_swiglu_limits=(None, None, 5.0, 5.0, None, 7.0, None))
    return build.abstract(cfg, dtype=jnp.bfloat16, quant=FORMATS[fmt], kernels="pallas")


@pytest.fixture(scope="module")
def model():
    return cut("int4")


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("speculative", [False, True], ids=["decode", "speculative"])
@pytest.mark.parametrize("tickets", [False, True], ids=["sums", "tickets"])
def test_the_served_step_lowers_for_the_gpu(fmt, speculative, tickets):
    model = cut(fmt)
    batch = 4 if speculative else 1  # the verify: 4 slots x 4 positions
    stepper = Stepper(model, new_slots(model, batch, 1024, 64), speculative=speculative, num_steps=3,
                      tickets=tickets)
    text = stepper.lower(platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") >= 6 * 3  # a layer's matvec, router and MoE launches at least


def test_a_verify_of_many_slots_lowers_its_projections_to_the_dense_gemm(model):
    """6 slots x 4 positions: the verify's 24 rows run the int4 projections and the lm_head through
    the grouped GEMM's dense kernel (`ling.quantize.QLinear` from 17 rows)."""
    stepper = Stepper(model, new_slots(model, 6, 1024, 64), speculative=True, num_steps=3, tickets=True)
    text = stepper.lower(platforms=("cuda",)).as_text()
    assert "dense_int4_m32_n128" in text


def test_the_prefill_chunk_and_the_mixed_iteration_lower_for_the_gpu(model, monkeypatch):
    """A 256-token chunk (the GPU's default) over both slots, and beside a speculative step over
    slot 0 (the tile-scheduled MoE). The MLA prefill's cuDNN attention is not Triton, and cannot
    lower without cuDNN present: its XLA form stands in."""
    import pallas_kernels.mla_prefill as mla_prefill

    monkeypatch.setattr(mla_prefill, "PALLAS_IMPL", "xla")
    b, width = 2, 256
    slots = new_slots(model, b, 1024, 64)
    prefiller = ChunkPrefiller(model)

    def chunk(rows):
        k = b if rows is None else len(rows)
        return prefiller.prepare(slots, start=np.ones(k, bool), params=SamplingParams.make(k, on_host=True),
                                 max_new=np.ones(k, np.int32), eos=np.full(k, -1, np.int32),
                                 tokens=np.zeros((k, width), np.int32), next_tokens=np.zeros((k, width), np.int32),
                                 valid=np.full(k, width, np.int32), ends=np.ones(k, bool), sampling=False, rows=rows)

    text = prefiller.lower(slots, chunk(None), platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") >= 6 * 3
    stepper = Stepper(model, slots, speculative=True, num_steps=3, tickets=True)
    text = stepper.lower(platforms=("cuda",), live=np.array([True, False]), chunk=chunk(np.array([1]))).as_text()
    assert text.count("__gpu$xla.gpu.triton") >= 6 * 6


@pytest.mark.parametrize("speculative", [False, True], ids=["decode", "speculative"])
def test_a_buckets_step_lowers_with_the_slots_stepped_in_place(model, speculative):
    """Two live slots of four in bucket 2: the kernels take the rows' slots of the whole state
    (`pallas_kernels.slot_rows`). The plain step copies no slot's recurrent state: no value of
    two slots' states [2, H, K, V] is made (a gather of the rows would make one)."""
    stepper = Stepper(model, new_slots(model, 4, 1024, 64), speculative=speculative, num_steps=3, tickets=True,
                      buckets=(2,))
    text = stepper.lower(platforms=("cuda",), live=np.array([False, True, False, True])).as_text()
    assert text.count("__gpu$xla.gpu.triton") >= 6 * 3
    cfg = model.cfg
    two_states = f"tensor<2x{cfg.kda_num_heads}x{cfg.kda_head_dim}x{cfg.kda_head_dim}xf32>"
    assert (two_states in text) == speculative  # the commit takes the accepted position's state
