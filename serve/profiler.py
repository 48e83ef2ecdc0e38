"""JAX profiler traces on demand (POST /start_profile, /stop_profile).

A trace directory holds plugins/profile/<run>/<host>.xplane.pb (open it in XProf / TensorBoard's
profile plugin) and perfetto_trace.json.gz (drag it into https://ui.perfetto.dev)."""

from __future__ import annotations

import os
import threading


class ProfilerError(RuntimeError):
    """Started twice, or stopped without a start."""


class Profiler:
    def __init__(self, default_dir: str):
        self.default_dir = default_dir
        self._dir: str | None = None
        self._lock = threading.Lock()

    def start(self, output_dir: str | None = None) -> str:
        import jax

        with self._lock:
            if self._dir is not None:
                raise ProfilerError(f"a profile is already being captured into {self._dir}; POST /stop_profile first")
            path = os.path.abspath(os.path.expanduser(output_dir or self.default_dir))
            try:
                os.makedirs(path, exist_ok=True)
            except OSError as e:
                raise ProfilerError(f"cannot create the profile directory {path}: {e}") from None
            try:
                jax.profiler.start_trace(path, create_perfetto_trace=True)
            except RuntimeError as e:  # a trace started elsewhere in the process
                raise ProfilerError(f"cannot start a trace: {e}") from None
            self._dir = path
            return path

    def stop(self) -> tuple[str, list[str]]:
        """Writes the trace; returns its directory and the files of this run."""
        import jax

        with self._lock:
            if self._dir is None:
                raise ProfilerError("no profile is being captured; POST /start_profile first")
            path, self._dir = self._dir, None
            jax.profiler.stop_trace()
            runs = os.path.join(path, "plugins", "profile")
            run = max((os.path.join(runs, d) for d in os.listdir(runs)), key=os.path.getmtime)  # this one
            return path, sorted(os.path.join(run, f) for f in os.listdir(run))
