"""The served step lowers for the GPU from a CPU machine: every Pallas kernel of the plain and the
speculative step goes through the Triton lowering, with Ling-3.0-flash's shapes and every SwiGLU
limit combination its layers use (routed and shared clamps, either or both), so a kernel that
cannot lower fails here rather than on the first GPU start-up. Nothing is allocated but the
slots: the weights are abstract."""

import dataclasses

import jax.numpy as jnp
import pytest

from ling import build
from ling.config import preset
from ling.quantize import Quantization
from spec.step import new_slots
from spec.stepper import Stepper


@pytest.fixture(scope="module")
def model():
    # layers 0-1 dense, 2-4 KDA + MoE, 5 MLA + MoE; limits (routed, shared): (-, 5), (4, 5), (-, -), (4, 7)
    cfg = preset("ling-3-flash").first_layers(6)
    cfg = dataclasses.replace(cfg, expert_swiglu_limits=(None, None, None, 4.0, None, 4.0, None),
                              shared_swiglu_limits=(None, None, 5.0, 5.0, None, 7.0, None))
    return build.abstract(cfg, dtype=jnp.bfloat16, quant=Quantization(4, experts=True, lm_head=True),
                          kernels="pallas")


@pytest.mark.parametrize("speculative", [False, True], ids=["decode", "speculative"])
@pytest.mark.parametrize("tickets", [False, True], ids=["sums", "tickets"])
def test_the_served_step_lowers_for_the_gpu(model, speculative, tickets):
    stepper = Stepper(model, new_slots(model, 1, 1024, 64), speculative=speculative, num_steps=3, tickets=tickets)
    text = stepper.lower(platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") >= 6 * 3  # a layer's matvec, router and MoE launches at least
