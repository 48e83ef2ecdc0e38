"""jax-triton 0.3's kernel calls lowered to jaxlib's command-buffer-compatible FFI target.

jax-triton 0.3 lowers `triton_call` to the legacy custom call "triton_kernel_call" (API version
2). XLA's command buffers (the CUDA graphs a compiled step runs as) take custom calls only through
FFI handlers marked compatible, so each legacy call ends a graph and the host launches the step in
pieces. jaxlib >= 0.11 registers "triton_kernel_call_ffi" (API version 4; the same compressed
TritonKernelCall proto, as its `opaque` attribute), a command-buffer compatible handler; jax-triton
0.4 lowers to it but needs triton >= 3.7, which the GPU image lacks. `use_ffi_target()` re-registers
jax-triton 0.3's CUDA lowering so that it ends in the FFI custom call; the kernel's compilation and
its proto are jax-triton's own.
"""

from __future__ import annotations

import functools
import threading

import jax

FFI_TARGET = "triton_kernel_call_ffi"
_lock = threading.RLock()
_registered = False


class FfiAdapter:
    """`jax.ffi` as jax-triton 0.3's lowering sees it: its legacy `ffi_lowering(target,
    api_version=2, backend_config=proto, operand_output_aliases=...)` becomes the FFI target's
    API version 4 call with the proto as the `opaque` attribute."""

    def __init__(self, ffi):
        self._ffi = ffi

    def __getattr__(self, name):
        return getattr(self._ffi, name)

    def ffi_lowering(self, target, *, api_version, backend_config, operand_output_aliases=None, **kwargs):
        del target, api_version  # the legacy call's
        rule = self._ffi.ffi_lowering(FFI_TARGET, api_version=4, operand_output_aliases=operand_output_aliases,
                                      **kwargs)
        return lambda ctx, *args: rule(ctx, *args, opaque=backend_config)


class _JaxWithFfiAdapter:
    """The jax module, but for its `ffi` attribute (what jax-triton's lowering calls)."""

    def __init__(self, module):
        self._module = module
        self.ffi = FfiAdapter(module.ffi)

    def __getattr__(self, name):
        return getattr(self._module, name)


def applies(jax_triton_version: str, jax_version: tuple) -> bool:
    """jax-triton before 0.4 (legacy target) on a jaxlib that has the FFI target (>= 0.11)."""
    major, minor = (int(p) for p in jax_triton_version.split(".")[:2])
    return (major, minor) < (0, 4) and tuple(jax_version[:2]) >= (0, 11)


def use_ffi_target() -> bool:
    """Make jax-triton's CUDA lowering end in FFI_TARGET where `applies`; idempotent. Returns
    whether the lowering is now the FFI one (False: jax-triton's own, already FFI or legacy)."""
    global _registered
    import jax_triton
    from jax.interpreters import mlir
    from jax_triton import triton_lib

    with _lock:
        if _registered:
            return True
        if not applies(jax_triton.__version__, jax.__version_info__):
            return False
        legacy = functools.partial(triton_lib.triton_kernel_call_lowering, triton_lib.get_cuda_backend)

        def lowering(ctx, *args, **params):
            with _lock:
                triton_lib.jax = _JaxWithFfiAdapter(jax)
                try:
                    return legacy(ctx, *args, **params)
                finally:
                    triton_lib.jax = jax

        mlir.register_lowering(triton_lib.triton_kernel_call_p, lowering, platform="cuda")
        _registered = True
        return True
