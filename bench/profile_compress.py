#!/usr/bin/env python3
"""Where one method's streaming compressions spend their time: a cProfile of
``Session.compress`` alone while a long text is ingested through a small cache
(the ingest setting of ``edgekv bench speed``: 256-token chunks, budget cells,
n_ctx = budget + 256).

    .venv/bin/edgekv bench run profile_compress --method lagkv --tokens 8192 --budget 1024

prints the compression count, the mean time per compression, its share of the
ingest and the profile's top entries by cumulative time. ``--oneshot`` profiles one
compression of a full cache of ``--tokens`` cells to ``--budget`` instead, as
``bench/stall.py`` times it (the prefill records the queries the method reads):

    .venv/bin/edgekv bench run profile_compress --method snapkv --tokens 4096 --budget 1024 --oneshot

The profiler adds its own overhead to Python-heavy code, so read the shares, not the absolute times.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--method", default="lagkv")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--cache-type", default="f16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--oneshot", action="store_true", help="one compression of a full cache, not streaming")
    a = ap.parse_args()

    from edgekv.bench.speed import long_text_tokens
    from edgekv.llama import Model
    from edgekv.models import resolve_model
    from edgekv.session import Session

    model = Model(resolve_model(a.model))
    toks = long_text_tokens(model, a.tokens)
    prof = cProfile.Profile()
    if a.oneshot:
        oneshot(model, toks, a, prof)
        return
    with Session(model, method=a.method, chunk=256, budget=a.budget, n_ctx=a.budget + 256,
                 cache_type_k=a.cache_type, cache_type_v=a.cache_type, n_threads=a.threads) as sess:
        compress = sess.compress

        def profiled(*args, **kw):
            prof.enable()
            try:
                return compress(*args, **kw)
            finally:
                prof.disable()

        sess.compress = profiled  # type: ignore[method-assign]
        t0 = time.perf_counter()
        sess.feed(toks)
        total = time.perf_counter() - t0
        st = sess.stats
    ev = max(st.compressions, 1)
    print(f"{a.method}: {a.tokens} tokens through {a.budget} cells in {total:.1f} s, {st.compressions} compressions, "
          f"{1000 * st.compress_seconds / ev:.0f} ms each, {100 * st.compress_seconds / total:.1f} % of ingest "
          "(profiled)")
    pstats.Stats(prof).sort_stats("cumulative").print_stats(a.top)
    model.close()


def oneshot(model, toks: list[int], a: argparse.Namespace, prof: cProfile.Profile) -> None:
    """Prefill a full cache, then profile one compression to --budget (after an unprofiled
    one, so that first-call costs are not in it)."""
    from edgekv.bench import protocol
    from edgekv.methods import METHODS
    from edgekv.session import Session

    cls = METHODS[a.method]
    with Session(model, method="full", n_ctx=len(toks) + 16, chunk=512, cache_type_k=a.cache_type,
                 cache_type_v=a.cache_type, n_threads=a.threads, observe=cls().queries_needed,
                 moments=cls.query_statistics) as sess:
        pre = protocol.prefill(sess, toks)
        first = protocol.compress_once(sess, pre, a.method, target=a.budget)
        prof.enable()
        again = protocol.compress_once(sess, pre, a.method, target=a.budget)
        prof.disable()
    print(f"{a.method}: one compression of {pre.n_cells} cells to {a.budget}: {first:.3f} s, then {again:.3f} s "
          "(profiled)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(a.top)
    model.close()


if __name__ == "__main__":
    main()
