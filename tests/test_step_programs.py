"""Every program the server compiles for a step (prefill chunk; decode or speculative step and its
report; at each batch bucket and cache length; the all-greedy and the sampling variant of each) holds no host round
trip: no data-dependent `cond` or `while`, no callback, no transfer to the host. On XLA:GPU each of
those copies a value to the host and waits for it, and splits the step's CUDA graph. Checked on the
jaxpr of each program, with the kernels the GPU runs (the Pallas backend, traced without lowering)
and with the reference backend that CPU serving runs; a Pallas kernel's own loops run inside the
kernel and are not looked into."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import core, source_info_util

import ling
from serve.runner import Runner

S = 3
ROUND_TRIPS = {"cond", "while", "pure_callback", "io_callback", "debug_callback", "callback", "infeed", "outfeed",
               "debug_print"}


def round_trips(jaxpr) -> list[str]:
    """The primitives in jaxpr (and every sub-jaxpr outside Pallas kernels) that make the host wait,
    each with the source line that made it."""
    found = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        to_host = name == "device_put" and any("host" in str(getattr(d, "memory_kind", "") or "")
                                               for d in eqn.params.get("devices", ()) or ())
        if name in ROUND_TRIPS or to_host:
            found.append(f"{name} at {source_info_util.summarize(eqn.source_info)}")
        if name == "pallas_call":
            continue
        for sub in core.jaxprs_in_params(eqn.params):
            found += round_trips(sub)
    return found


def packed_chunk(prefiller, n: int, c: int):
    """A prefill chunk's packed arguments for n rows of c tokens (their values do not matter here)."""
    from spec.sampling import SamplingParams

    params = SamplingParams.make(n, temperature=0.5, on_host=True)
    return jnp.asarray(prefiller._pack(np.ones(n, bool), params, np.zeros(n), np.zeros(n), np.zeros((n, c)),
                                       np.zeros((n, c)), np.ones(n), np.ones(n, bool)))


def programs(runner: Runner):
    """(name, jaxpr) of each program the runner compiles: prefill chunk, step and mixed iteration
    at each batch bucket and cache length, both sampling variants, the variant that reports
    log-probabilities, and calls of several steps (`Stepper.steps_per_call`)."""
    stepper, prefiller = runner.stepper, runner.prefiller
    b, c = runner.max_batch, 8
    for sampling, logprobs in ((False, False), (True, False), (True, True)):
        variant = f"sampling={sampling} logprobs={logprobs}"
        calls = (1,) if logprobs else (1, 3) if not sampling else (3,)  # steps a call: one, or several
        for k in stepper.buckets:  # every batch bucket's step
            rows = stepper.rows(np.arange(b) < k)
            on_device = None if rows is None else jnp.asarray(rows)
            for context, steps in itertools.product((*stepper.contexts, None), calls):
                yield f"step batch {k} context {context} steps {steps} {variant}", jax.make_jaxpr(
                    stepper._step, static_argnums=(5, 6, 7, 8, 9))(stepper._params, stepper._slots, stepper._counts,
                                                                   on_device, None, sampling, logprobs, context, False,
                                                                   steps)
            # the mixed iteration: the step beside a one-row prefill chunk
            chunk = (jnp.zeros(1, jnp.int32), packed_chunk(prefiller, 1, c))
            for context in (*prefiller.contexts, None):
                yield f"mixed step batch {k} context {context} {variant}", jax.make_jaxpr(
                    stepper._step, static_argnums=(5, 6, 7, 8, 9))(stepper._params, stepper._slots, stepper._counts,
                                                                   on_device, chunk, sampling, logprobs, context,
                                                                   logprobs, 1)
            yield f"report batch {k} {variant}", jax.make_jaxpr(stepper._report, static_argnums=(7, 8))(
                *(stepper._slots[i] for i in stepper._read), stepper._counts[0], on_device, logprobs,
                1 if logprobs else 3)
        for k in stepper.buckets:  # every batch bucket's prefill chunk and the report of its first tokens
            rows = stepper.rows(np.arange(b) < k)
            n = b if rows is None else len(rows)
            on_device = None if rows is None else jnp.asarray(rows)
            packed = packed_chunk(prefiller, n, c)
            for context in (*prefiller.contexts, None):
                yield f"prefill batch {k} context {context} {variant}", jax.make_jaxpr(
                    prefiller._call, static_argnums=(4, 5, 6))(prefiller._params, stepper.slots, on_device, packed,
                                                               sampling, logprobs, context)
            s = stepper.slots
            yield f"prefill report batch {k} {variant}", jax.make_jaxpr(prefiller._report, static_argnums=5)(
                s.out, s.logprobs, s.top_ids, on_device, packed, logprobs)
    pool, i = runner.pool, np.int32(0)
    if pool is not None:  # the prefix cache's save, restore and NEXTN completion
        yield "prefix save", jax.make_jaxpr(pool._save)(pool.pool, stepper.slots, i, i, i)
        yield "prefix restore", jax.make_jaxpr(pool._restore)(pool.pool, stepper.slots, i, np.zeros(pool.pages, np.int32),
                                                              i, np.zeros(pool.pages * pool.interval, np.int32))
        yield "prefix complete", jax.make_jaxpr(pool._complete)(pool._params, stepper.slots, i)


def quantized_tiny():
    from ling.quantize import quantize_model

    return quantize_model(ling.load("ling-tiny", dtype="float32"), bits=4, group_size=32, lm_head=True, experts=True)


@pytest.mark.parametrize("backend", ["reference", "pallas"])
@pytest.mark.parametrize("spec_steps", [0, S])
@pytest.mark.parametrize("weights", ["float32", "int4"])
def test_step_programs_hold_no_host_round_trip(backend, spec_steps, weights):
    model = ling.load("ling-tiny", dtype="float32") if weights == "float32" else quantized_tiny()
    ling.use_kernels(model, backend)
    runner = Runner(model, max_batch=2, max_seq_len=64, speculative_steps=spec_steps, contexts=(16,),
                    prefix_entries=2, prefix_interval=16)
    seen = 0
    for name, jaxpr in programs(runner):
        bad = round_trips(jaxpr.jaxpr)
        assert not bad, f"{name} ({backend}, {weights}, S={spec_steps}) makes the host wait:\n  " + "\n  ".join(bad)
        seen += 1
    # 2 buckets x (mixed iteration at 2, prefill at 2, and their reports) x 3 variants, and the step
    # at each context in 4 calls (greedy of 1 and 3 steps, sampling of 3, with logprobs of 1); the
    # step alone has context buckets only where its attention reads the whole cache; and the prefix
    # cache's 3 programs.
    step_contexts = 2 if backend == "reference" else 1
    assert runner.stepper.buckets == (1, 2) and seen == 2 * (4 * step_contexts + 3 * (2 + 1 + 2 + 1)) + 3


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_block_drafting_programs_hold_no_host_round_trip(backend):
    """The same with the DSpark block drafter, its confidence scheduling (threshold and the budget
    shared across slots) chosen on the device."""
    from flax import nnx

    from ling import dspark
    from spec.step import BlockDrafter

    target = ling.load("ling-tiny", dtype="float32")
    cfg = dspark.default_config(target.cfg, block_size=4, num_layers=1, num_heads=2, head_dim=16,
                                intermediate_size=64, markov_rank=8)
    model = target.attach_dspark(dspark.DSparkDrafter(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    ling.use_kernels(model, backend)
    runner = Runner(model, max_batch=2, max_seq_len=64, speculative_steps=4,
                    drafter=BlockDrafter(scheduled=True, threshold=0.5, budget=3))
    seen = 0
    for name, jaxpr in programs(runner):
        bad = round_trips(jaxpr.jaxpr)
        assert not bad, f"{name} ({backend}, dspark) makes the host wait:\n  " + "\n  ".join(bad)
        seen += 1
    # 2 buckets x ((mixed iteration, prefill and their reports) x 3 variants, and the step in 4 calls)
    assert seen == 2 * (3 * 4 + 4)


def test_a_chunk_refuses_device_arguments():
    """The chunk's arguments are packed on the host: a device array among them (reading it back
    would wait for every step queued before it) is refused, by name."""
    from spec.sampling import SamplingParams
    from spec.stepper import ChunkPrefiller

    n, c = 2, 4
    host = [np.ones(n, bool), SamplingParams.make(n, on_host=True), np.zeros(n), np.zeros(n), np.zeros((n, c)),
            np.zeros((n, c)), np.ones(n), np.ones(n, bool)]
    assert ChunkPrefiller._pack(*host).shape == (n, 2 * c + 12)
    with pytest.raises(TypeError, match="params.temperature, params.top_k"):
        ChunkPrefiller._pack(host[0], SamplingParams.make(n), *host[2:])
    with pytest.raises(TypeError, match="tokens on the device"):
        ChunkPrefiller._pack(*host[:4], jnp.zeros((n, c), jnp.int32), *host[5:])


def test_the_check_finds_a_cond_and_names_its_line():
    """The walker is not vacuous: a cond on a traced predicate (what sampling once held) is found,
    inside a jit, with this file's line."""
    def step(x):
        return jax.lax.cond(jnp.all(x > 0), lambda: x + 1, lambda: x - 1)

    bad = round_trips(jax.make_jaxpr(jax.jit(step))(np.ones(3, np.float32)).jaxpr)
    assert len(bad) == 1 and bad[0].startswith("cond at ") and "test_step_programs.py" in bad[0]
    cb = round_trips(jax.make_jaxpr(lambda x: jax.pure_callback(np.sin, x, x))(np.ones(3, np.float32)).jaxpr)
    assert cb and cb[0].startswith("pure_callback")


def test_the_ticket_step_holds_no_host_round_trip():
    """The step with ticket sums (`Stepper(tickets=True)`: atomics inside the kernels, counters
    threaded through them) is one program without a host round trip, plain and speculative."""
    from spec.step import new_slots
    from spec.stepper import Stepper

    model = quantized_tiny()
    ling.use_kernels(model, "pallas")
    slots = new_slots(model, 2, 64, 16)
    for steps in (0, S):
        stepper = Stepper(model, slots, speculative=steps > 0, num_steps=max(steps, 1), tickets=True)
        jaxpr = jax.make_jaxpr(stepper._step, static_argnums=(5, 6, 7, 8, 9))(
            stepper._params, stepper._slots, stepper._counts, None, None, False, False, None, False, 2)
        bad = round_trips(jaxpr.jaxpr)
        assert not bad, f"S={steps}: " + "\n  ".join(bad)
        assert "atomic_rmw" in str(jaxpr)  # the ticket kernels are in it
