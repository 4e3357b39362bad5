"""Tensors of llama.cpp's compute graph, copied to the host while it decodes.

llama.cpp hands every graph node to an eval callback (``cb_eval``) that must
be set when the context is created. ``native/capture.c`` is that callback: it
keeps the last evaluation of each ``<name>-<layer>`` a caller asked for
(``Qcur-3`` is layer 3's post-RoPE queries, ``kqv_out-3`` its attention
output before the output projection) and answers "not needed" for every other
node, so an idle capture leaves the graph in one piece. Built by
``native/build_native.py`` against ggml's public headers: it works with stock
and patched libllama alike.
"""

from __future__ import annotations

import ctypes
from functools import cache

import numpy as np

from .errors import EdgekvError


@cache
def _module():
    try:
        from . import _edgekv_capture as m  # type: ignore[attr-defined]
    except ImportError:
        return None
    return m


def available() -> bool:
    return _module() is not None


class Capture:
    """Host copies of named graph tensors, per layer, refreshed by every decode.

    ``want("Qcur", layers)`` asks for tensors; ``get("Qcur", il)`` returns the
    last one a decode evaluated, shaped as ggml's ``ne`` reversed (numpy order),
    or None when the last decode did not evaluate it. The C callback writes
    while ``llama_decode`` runs on the caller's thread, so reads between
    decodes are safe; a capture belongs to one context.
    """

    def __init__(self, n_layer: int) -> None:
        m = _module()
        if m is None:
            raise EdgekvError("the tensor capture is not built (run native/build_native.py)")
        self._ffi, self._lib = m.ffi, m.lib
        ptr = self._lib.edgekv_capture_new(n_layer)
        if ptr == self._ffi.NULL:
            raise EdgekvError(f"cannot create a tensor capture for {n_layer} layers")
        self._c = self._ffi.gc(ptr, self._lib.edgekv_capture_free)
        self.n_layer = n_layer
        self._wanted: dict[tuple[str, int], int] = {}  # (name, layer) -> how many ask for it

    # what llama_context_params takes
    def callback_address(self) -> int:
        return int(self._ffi.cast("uintptr_t", self._ffi.addressof(self._lib, "edgekv_capture_eval")))

    def user_data(self) -> ctypes.c_void_p:
        return ctypes.c_void_p(int(self._ffi.cast("uintptr_t", self._c)))

    def want(self, name: str, layers: range | list[int] | None = None, on: bool = True) -> None:
        """Ask for a tensor (``on``), or take one's asking back. Asks are counted, so that
        several sequences of one context (``edgekv.lanes``) each ask and each take theirs
        back: a tensor is captured while anyone still wants it."""
        for il in range(self.n_layer) if layers is None else layers:
            key = (name, il)
            n = self._wanted.get(key, 0)
            if not on and n == 0:
                continue
            self._wanted[key] = n + 1 if on else n - 1
            if (on and n > 0) or (not on and n > 1):
                continue
            if self._lib.edgekv_capture_want(self._c, name.encode(), il, on) != 0:
                self._wanted[key] = n
                raise EdgekvError(f"cannot capture {name!r} of layer {il} (at most 4 names, "
                                  f"layers 0..{self.n_layer - 1}, each captured one way)")

    def want_sums(self, name: str, layers: range | list[int] | None = None, on: bool = True) -> None:
        """Ask for an attention softmax (``kq_soft_max``) reduced as it is evaluated:
        ``column_sums`` then returns what each cell received, without copying the softmax."""
        for il in range(self.n_layer) if layers is None else layers:
            if self._lib.edgekv_capture_want_sums(self._c, name.encode(), il, on) != 0:
                raise EdgekvError(f"cannot capture the sums of {name!r} of layer {il} (at most 4 names, "
                                  f"layers 0..{self.n_layer - 1}, each captured one way)")

    def clear(self) -> None:
        """Forget what earlier decodes captured (the buffers stay allocated)."""
        self._lib.edgekv_capture_clear(self._c)

    def get(self, name: str, layer: int) -> np.ndarray | None:
        status = self._lib.edgekv_capture_status(self._c)
        if status != 0:
            raise EdgekvError(f"tensor capture failed (status {status}: a wanted tensor is not float32 "
                              "with contiguous rows, or memory ran out)")
        s = self._lib.edgekv_capture_get(self._c, name.encode(), layer)
        if s == self._ffi.NULL or s.n_seen == 0:
            return None
        ne = [int(s.ne[i]) for i in range(4)]
        n = ne[0] * ne[1] * ne[2] * ne[3]
        buf = self._ffi.buffer(s.data, n * 4)
        return np.frombuffer(buf, dtype=np.float32).copy().reshape(ne[::-1])

    def column_sums(self, name: str, layer: int) -> tuple[np.ndarray, np.ndarray] | None:
        """What the last decode's attention paid each cell of ``layer`` (asked for with
        ``want_sums``): (float32 [n_head, width], per head the softmax summed over the
        decode's tokens; the cell indices int [m] the mask let its last token see, in cell
        order), columns in the cache's own cell order; None when nothing was evaluated."""
        t = self.get(name, layer)
        if t is None:
            return None
        t = t.reshape(t.shape[-2:])
        return t[:-1], np.flatnonzero(t[-1])
