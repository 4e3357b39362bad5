"""Conversations across stateless requests: recognise them, keep them live, save, resume.

The OpenAI API resends the whole message list every turn, while a compressed
cache cannot be matched token by token against it: it no longer holds every
token. So each conversation keeps what its cache was fed, as messages and as
text. A request whose messages extend a known conversation's (its own reply
included) feeds only the new suffix into that conversation's cache; a request
that edits the past starts a new conversation.

Every live conversation has a ``Session`` on the one loaded model: a llama.cpp
context of its own, or with ``batch``, one of ``max_live`` sequences (lanes)
of one shared context, whose generated tokens are decoded together
(``edgekv.lanes``; the methods a lane cannot run, ``Lanes.refusal``, keep a
context of their own). At most ``max_live``
conversations are live; beyond that the least recently used idle one is
written to a session file and its session becomes a spare, and it is loaded
again when a request continues it. Only the worker thread mutates the store;
``lock`` guards what the stats endpoint reads.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

from ..config import BudgetRule, ContextOptions
from ..errors import EdgekvError
from ..lanes import Lanes
from ..llama import Model
from ..methods import METHODS, Method
from ..session import Session, Stats
from . import journal

log = logging.getLogger("edgekv.server")


@dataclass(frozen=True)
class Settings:
    """How one conversation's cache is compressed, chosen by its first request."""

    method: str
    budget: int | None = None
    ratio: float | None = None
    params: tuple[tuple[str, object], ...] = ()

    def rule(self, capacity: int) -> BudgetRule:
        """These settings as a budget rule in contexts of ``capacity`` cells (``build`` checks
        it: the one-line errors for settings no conversation could run with)."""
        return BudgetRule(self.method, self.budget, self.ratio, self.params, capacity)


@dataclass
class ServerConfig:
    """What every conversation shares: the model, the context shape and the server's limits."""

    model: Model
    model_id: str
    n_ctx: int
    defaults: Settings
    state_dir: Path
    options: ContextOptions = field(default_factory=ContextOptions)
    max_live: int = 4
    max_conversations: int = 256
    max_prompt_tokens: int = 16384
    max_tokens: int = 512
    temperature: float = 0.7
    persist: bool = False  # conversations outlive the server, and a crash: recorded in state_dir at every turn
    batch: bool = False  # conversations share one context, their tokens decoded together (edgekv.lanes)
    room: int = 0  # cells made free after each turn, while the worker is idle (Session.make_room); 0: none

    def settings(self, method: str | None, budget: int | None, ratio: float | None,
                 params: dict[str, object] | None) -> Settings:
        """A request's choice, completed by the server's defaults (a method named without a
        budget or ratio takes the server's budget rule, unless it is ``full``)."""
        d = self.defaults
        if method is None and budget is None and ratio is None and not params:
            return d
        method = method or d.method
        if budget is None and ratio is None and method != "full":
            budget, ratio = d.budget, d.ratio
        if params is None and method == d.method:  # the server's --param values go with its method
            return Settings(method, budget, ratio, d.params)
        return Settings(method, budget, ratio, tuple(sorted((params or {}).items())))


@dataclass
class Conversation:
    """One conversation: what its cache holds and where the cache is (a live context or a file)."""

    id: str
    kind: str  # "chat" or "completion"
    settings: Settings
    rule: BudgetRule  # the settings, checked, in the server's contexts
    method: Method  # built once per conversation per server run, from the rule
    messages: list[dict[str, str]] = field(default_factory=list)  # chat: as fed, the replies included
    text: str = ""  # what the cache was fed, as the client sees it (its replies as sent)
    reply_len: int = 0  # characters of the last reply, the part of ``text`` a client may trim
    session: Session | None = None
    file: Path | None = None
    file_current: bool = False  # ``file`` holds exactly what the conversation's text says its cache was fed
    rebuild: bool = False  # no cache anywhere (after a crash): its next turn prefills the whole text again
    stats: Stats | None = None  # the session's counters, kept while it is on disk
    merges: bool = False  # the method merges cells instead of evicting them
    busy: bool = False
    last_used: float = field(default_factory=time.time)
    requests: int = 0
    prefill: tuple[int, int] | None = None  # (done, total) while a prompt is being fed

    @property
    def live(self) -> bool:
        return self.session is not None

    def current_stats(self) -> Stats | None:
        return self.session.stats if self.session is not None else self.stats


def _same_message(a: dict[str, str], b: dict[str, str]) -> bool:
    if a["role"] != b["role"]:
        return False
    if a["role"] == "assistant":  # clients may trim a reply they display
        return a["content"].strip() == b["content"].strip()
    return a["content"] == b["content"]


class Store:
    """All conversations of one server, the live ones in least-recently-used order."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.convs: OrderedDict[str, Conversation] = OrderedDict()  # oldest use first
        self.lock = threading.Lock()
        self._spare: list[Session] = []  # contexts no conversation holds, kept for the next one
        self._lane_spare: list[Session] = []  # with ``batch``: sequences of the shared context no one holds
        self.lanes: Lanes | None = None  # with ``batch``: the shared context, made by ``warm``
        self._first: Session | None = None  # the first context made: what every context's engine can run
        self.default_rule = cfg.defaults.rule(cfg.n_ctx)
        self.saves = 0
        self.resumes = 0
        self.created = 0  # conversations made by this server (a refused request makes none)
        self.abandoned = 0  # dropped because their turn did not finish (a client walked away)
        self.rooms: deque[Conversation] = deque()  # turns ended: room to make for their next ones
        self.rooms_made = 0  # compressions run between requests (``room``)
        self.forgotten = 0  # dropped past max_conversations
        cfg.state_dir.mkdir(parents=True, exist_ok=True)
        if cfg.persist:
            self._load()

    # -- finding ---------------------------------------------------------------
    def find_chat(self, messages: list[dict[str, str]], settings: Settings | None) -> Conversation | None:
        """The idle conversation whose messages (its replies included) the request's extend,
        the longest such; ``settings`` None matches any."""
        best: Conversation | None = None
        for conv in self.convs.values():
            if conv.kind != "chat" or conv.busy or (settings is not None and conv.settings != settings):
                continue
            k = len(conv.messages)
            if k == 0 or k >= len(messages) or not all(map(_same_message, conv.messages, messages[:k])):
                continue
            if best is None or k > len(best.messages):
                best = conv
        return best

    def find_completion(self, prompt: str, settings: Settings | None) -> Conversation | None:
        best: Conversation | None = None
        for conv in self.convs.values():
            if conv.kind != "completion" or conv.busy or (settings is not None and conv.settings != settings):
                continue
            if conv.text and len(conv.text) < len(prompt) and prompt.startswith(conv.text):
                if best is None or len(conv.text) > len(best.text):
                    best = conv
        return best

    # -- lifecycle ---------------------------------------------------------------
    def new(self, kind: str, settings: Settings | None = None, rule: BudgetRule | None = None,
            method: Method | None = None) -> Conversation:
        """A new conversation, busy (claimed by the turn that makes it): the request's checked
        settings, rule and method (built by the request handler), or the server's defaults."""
        if settings is None:
            settings, rule = self.cfg.defaults, self.default_rule
        assert rule is not None
        conv = Conversation(id="conv-" + uuid.uuid4().hex[:16], kind=kind, settings=settings, rule=rule,
                            method=rule.build() if method is None else method, busy=True)
        with self.lock:
            self.convs[conv.id] = conv
            self.created += 1
        self._forget_oldest()
        return conv

    def touch(self, conv: Conversation) -> None:
        conv.last_used = time.time()
        with self.lock:
            self.convs.move_to_end(conv.id)

    def make_live(self, conv: Conversation) -> bool:
        """Give ``conv`` a context, saving the least recently used idle conversation to disk if
        all ``max_live`` are taken; False when every live one is busy (try again later).

        Contexts are reused, never freed while the server runs: every conversation has the
        same context shape, and creating and freeing contexts at every save and resume grew
        the server's memory by 14 % over a 16-conversation load test (bench/server_load.py)."""
        if conv.live:
            return True
        lane = self.lanes is not None and self.lanes.accepts(conv.method)
        pool = self._lane_spare if lane else self._spare
        live = [c for c in self.convs.values() if c.live]
        if len(live) >= self.cfg.max_live:  # asked whatever the pools hold: with lanes there are two
            idle = [c for c in live if not c.busy]
            if not idle:
                return False
            # the least recently used, of the kind this conversation needs where one is idle
            same = [c for c in idle if c.session is not None and (c.session.lanes is not None) == lane]
            self.save((same or idle)[0])
        if not pool:
            pool.append(self._new_session(lane))
        sess = pool[-1]
        sess.reset()
        sess.apply(conv.rule, conv.method)  # one-line errors, and the spare stays spare
        if conv.file is not None:
            sess.load_file(conv.file)
            if conv.stats is not None:
                conv.stats.cells = sess.engine.n_cells
                sess.stats = conv.stats
            self.resumes += 1
        pool.pop()
        conv.merges = "merge" in sess.method.needs
        with self.lock:
            conv.session, conv.stats = sess, None
        return True

    def warm(self) -> None:
        """Make the first context now and give it the default settings: a default method this
        model's engine cannot run fails at start, with one line, not on every request."""
        if not self._spare:
            self._spare.append(self._new_session())
        self._spare[-1].apply(self.default_rule)
        if self.cfg.batch and self.lanes is None:
            if self.cfg.options.engine == "native":
                raise EdgekvError("--batch decodes conversations on the state engine (the native ops act on a "
                                  "context of one sequence): leave --engine at auto or state")
            self.lanes = Lanes(self.cfg.model, self.cfg.max_live, self.cfg.n_ctx, self.cfg.options)

    def check_method(self, method: Method) -> None:
        """The one-line error for a method the server's engine cannot run (every context has
        the same shape, so the first one answers for all), before any conversation exists."""
        if self._first is None:  # warm() makes it when the server starts
            raise EdgekvError("the server has no context yet")
        self._first.check_method(method)
        have = self._first.stats.scratch_cells
        if method.scratch_cells > have:
            raise EdgekvError(
                f"method {method.name!r} needs {method.scratch_cells} cells beside each conversation's for its "
                f"own passes, and this server's contexts have {have}: start the server with --method "
                f"{method.name} (with these parameters) to size them for it")

    def _new_session(self, lane: bool = False) -> Session:
        """A context (or a lane of the shared one) for any conversation: made with no method,
        so its batch is the server's whole chunk; ``apply`` gives it each conversation's rule
        and method in turn."""
        cfg = self.cfg
        rule = BudgetRule("full", capacity=cfg.n_ctx)
        if lane:
            return Session(cfg.model, options=cfg.options, rule=rule, lanes=self.lanes)
        sess = Session(cfg.model, options=cfg.options, rule=rule, scratch_cells=self.default_rule.build().scratch_cells)
        if self._first is None:
            self._first = sess
        return sess

    def _spare_again(self, sess: Session) -> None:
        sess.discard_queued()  # a dropped conversation's last token is not decoded into the spare
        (self._lane_spare if sess.lanes is not None else self._spare).append(sess)

    def save(self, conv: Conversation) -> None:
        """Write a live conversation to its session file; its context becomes a spare. With
        ``persist``, its record then names the file (file first: a crash between the two leaves
        the old record, which does not name these bytes)."""
        assert conv.session is not None and not conv.busy
        path = journal.cache_path(self.cfg.state_dir, conv.id)
        if not conv.file_current:  # resumed and not changed since: the file already holds it
            conv.session.save_file(path)
        with self.lock:
            conv.file, conv.stats = path, conv.session.stats
            sess, conv.session = conv.session, None
        conv.file_current = True
        self._spare_again(sess)
        self.saves += 1
        if self.cfg.persist and conv.requests:
            self.commit(conv)

    def want_room(self, conv: Conversation) -> None:
        """A turn of ``conv`` ended: with ``room``, its next turn's compression is to run while
        the worker has nothing else to do (``make_room``)."""
        if self.cfg.room and conv.method.compresses:
            self.rooms.append(conv)

    def make_room(self, conv: Conversation) -> None:
        """Run the compression ``conv``'s next turn would start with (``Session.make_room``), in
        the worker between requests: that turn's first token then does not wait for it. A
        conversation since saved, dropped or claimed is left alone. Its session file, if any,
        no longer holds the cache (it still holds one for the same text, which a crash resumes).
        A failure drops the conversation, as a failed turn does."""
        if conv.busy or conv.session is None or self.convs.get(conv.id) is not conv:
            return
        try:
            if conv.session.make_room(self.cfg.room):
                conv.file_current = False
                self.rooms_made += 1
        except Exception:  # its cache may be half compressed: as a failed turn, it goes
            log.exception("making room in conversation %s failed; it is dropped", conv.id)
            self.drop(conv)

    def commit(self, conv: Conversation) -> None:
        """With ``persist``, make the conversation's completed turns durable: its record,
        written atomically (``journal``), naming its session file while that file is current."""
        if not self.cfg.persist:
            return
        s = conv.settings
        journal.write(self.cfg.state_dir, self._shape(), journal.Entry(
            id=conv.id, kind=conv.kind,
            settings={"method": s.method, "budget": s.budget, "ratio": s.ratio, "params": dict(s.params)},
            messages=conv.messages, text=conv.text, reply_len=conv.reply_len, requests=conv.requests,
            last_used=conv.last_used, stats=conv.current_stats(),
            cache=conv.file if conv.file_current else None))

    def drop(self, conv: Conversation) -> None:
        """Forget a conversation: its file goes, its context becomes a spare."""
        with self.lock:
            self.convs.pop(conv.id, None)
            sess, conv.session = conv.session, None
        if sess is not None:
            self._spare_again(sess)
        if self.cfg.persist:
            journal.remove(self.cfg.state_dir, conv.id)  # its record, then its cache file
        elif conv.file is not None:
            conv.file.unlink(missing_ok=True)
        conv.file, conv.file_current = None, False

    def abandon(self, conv: Conversation) -> None:
        """A turn that did not finish: the cache may hold half of it, so the conversation goes
        (the client's next request starts it over from its messages)."""
        self.drop(conv)
        self.abandoned += 1

    def _forget_oldest(self) -> None:
        """Past ``max_conversations``, the least recently used idle ones are forgotten (a later
        request for one starts over from its messages: slower, nothing wrong)."""
        while len(self.convs) > self.cfg.max_conversations:
            idle = [c for c in self.convs.values() if not c.busy]
            if not idle:
                return
            self.drop(idle[0])
            self.forgotten += 1

    def close(self) -> None:
        """Free every context; with ``persist``, save every conversation's cache so the next
        server resumes it without a prefill (its record is already on disk), else forget them
        and their files."""
        if self.cfg.persist:
            for conv in list(self.convs.values()):
                if conv.live and not conv.busy and conv.requests:
                    self.save(conv)
        else:
            for conv in list(self.convs.values()):
                self.drop(conv)
        for sess in self._spare + self._lane_spare:
            sess.close()
        self._spare.clear()
        self._lane_spare.clear()
        if self.lanes is not None:
            self.lanes.close()
            self.lanes = None

    # -- persistence ---------------------------------------------------------------
    def _shape(self) -> dict[str, object]:
        """What saved conversations must share with the server that resumes them."""
        c = self.cfg
        return {"model": c.model.path.name, "model_size": c.model.path.stat().st_size, "n_ctx": c.n_ctx,
                "cache_type_k": c.options.cache_type_k, "cache_type_v": c.options.cache_type_v}

    def _load(self) -> None:
        """The conversations recorded in state_dir (``journal.load``: one line and no start for a
        directory of another server), each with its cache where its record names the file."""
        for e in journal.load(self.cfg.state_dir, self._shape()):
            st = e.settings
            settings = Settings(st["method"], st["budget"], st["ratio"], tuple(sorted(st["params"].items())))
            rule = settings.rule(self.cfg.n_ctx)
            try:
                method = rule.build()
            except EdgekvError as err:  # settings this edgekv no longer runs: a request starts over
                log.warning("conversation %s is not resumed: %s", e.id, err)
                journal.remove(self.cfg.state_dir, e.id)
                continue
            self.convs[e.id] = Conversation(
                id=e.id, kind=e.kind, settings=settings, rule=rule, method=method, messages=e.messages,
                text=e.text, reply_len=e.reply_len, requests=e.requests, last_used=e.last_used, stats=e.stats,
                file=e.cache, file_current=e.cache is not None, rebuild=e.cache is None)

    # -- reporting -------------------------------------------------------------------
    def describe(self, conv: Conversation) -> dict[str, object]:
        s = conv.current_stats()
        cells = s.cells if s else 0
        per_cell = s.kv_bytes_per_cell if s else 0
        removed = s.tokens_evicted if s else 0
        return {
            "id": conv.id, "kind": conv.kind, "method": conv.settings.method,
            "budget": conv.settings.budget, "ratio": conv.settings.ratio,
            "params": dict(conv.settings.params),
            "state": "busy" if conv.busy else ("live" if conv.live else ("saved" if conv.file_current else
                                                                       "messages" if conv.rebuild else "new")),
            "live": conv.live,
            "capacity": self.cfg.n_ctx, "cells": cells, "peak_cells": s.peak_cells if s else 0,
            "compressions": s.compressions if s else 0, "tokens_seen": s.tokens_seen if s else 0,
            "tokens_evicted": 0 if conv.merges else removed, "tokens_merged": removed if conv.merges else 0,
            "kv_bytes": cells * per_cell, "kv_bytes_allocated": self.cfg.n_ctx * per_cell if conv.live else 0,
            "events": [list(e) for e in (s.events[-64:] if s else [])],
            "prefill": list(conv.prefill) if conv.prefill else None,
            "requests": conv.requests, "last_used": conv.last_used,
            "engine": conv.session.engine.name if conv.session is not None else None,
            "lane": conv.session is not None and conv.session.lanes is not None,
        }

    def snapshot(self) -> dict[str, object]:
        with self.lock:
            convs = [self.describe(c) for c in self.convs.values()]
        live = [c for c in convs if c["live"]]
        return {
            "model": self.cfg.model_id, "n_ctx": self.cfg.n_ctx, "max_live": self.cfg.max_live,
            "max_prompt_tokens": self.cfg.max_prompt_tokens,
            "defaults": {"method": self.cfg.defaults.method, "budget": self.cfg.defaults.budget,
                         "ratio": self.cfg.defaults.ratio},
            "methods": list(METHODS),
            "conversations": convs,
            "totals": {
                "conversations": len(convs), "live": len(live), "saved": sum(c["state"] == "saved" for c in convs),
                "cells": sum(int(c["cells"]) for c in live),
                "kv_bytes": sum(int(c["kv_bytes"]) for c in live),
                "kv_bytes_allocated": sum(int(c["kv_bytes_allocated"]) for c in live),
                "saves": self.saves, "resumes": self.resumes, "rooms_made": self.rooms_made,
                "created": self.created, "abandoned": self.abandoned, "forgotten": self.forgotten,
                "batched_steps": self.lanes.steps if self.lanes is not None else 0,
                "batched_tokens": self.lanes.tokens if self.lanes is not None else 0,
            },
        }


__all__ = ["Conversation", "ServerConfig", "Settings", "Store"]
