"""bench.step's reading of a compiled program (bench/step_categories.py): the copies of whole
buffers it makes, from a program compiled here."""

import jax
import jax.numpy as jnp

from bench.step_categories import big_copies, category


def test_big_copies_finds_a_buffer_that_could_not_be_updated_in_place():
    """A donated buffer updated in place costs no copy; returned beside its update it must be
    copied whole. Copies under the size asked for, and ops inside fusion bodies, are not listed."""
    x = jnp.zeros((1024, 2048), jnp.float32)  # 8.4 MB
    in_place = jax.jit(lambda x: x.at[0].set(1.0), donate_argnums=0).lower(x).compile().as_text()
    kept = jax.jit(lambda x: (x.at[0].set(1.0), x), donate_argnums=0).lower(x).compile().as_text()
    assert big_copies(in_place) == []
    copies = big_copies(kept)
    assert copies and all(c["shape"] == "f32[1024,2048]" and c["bytes"] == 1024 * 2048 * 4 for c in copies)
    assert big_copies(kept, min_bytes=1e9) == []
    fused = ("%fused_copy (p: f32[4096,1024]) -> f32[4096,1024] {\n"
             "  ROOT %copy.3 = f32[4096,1024]{0,1} copy(%p)\n}\n\n"
             "ENTRY %main (a: f32[4096,1024]) -> f32[4096,1024] {\n"
             "  %a = f32[4096,1024]{1,0} parameter(0)\n"
             "  ROOT %wrapped_copy = f32[4096,1024]{0,1} fusion(%a), kind=kLoop, calls=%fused_copy, "
             "metadata={op_name=\"jit(run)/commit/transpose\"}\n}\n")
    assert big_copies(fused) == [dict(name="wrapped_copy", shape="f32[4096,1024]", bytes=4096 * 1024 * 4,
                                      op_name="jit(run)/commit/transpose")]


def test_the_routers_kernels_count_as_the_router():
    """The fused router ("router", and XLA's numbered copies of a kernel's name) and the selection
    kernel alone are the router's time, not other glue; the router's XLA ops go by their scope."""
    for name in ("router", "router__1", "router_select"):
        assert category(name, {}) == "router (Pallas)"
    assert category("loop_select_fusion_3", {"loop_select_fusion": "jit(run)/router/sigmoid"}) == "router"
    assert category("loop_select_fusion_3", {}) == "other glue"
