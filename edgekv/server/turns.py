"""One request's turn, as steps the worker interleaves with other conversations' steps.

llama.cpp computes on all cores at once, so requests are not run in parallel
threads: one worker thread takes the active turns round-robin, one step each
(a prefill chunk or one generated token), so four conversations stream at the
same time instead of one after another.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ..config import BudgetRule
from ..errors import EdgekvError
from ..llama import SamplerConfig
from ..methods import Method
from ..session import Reply, Session, common_prefix
from .conversations import Conversation, Settings, Store

log = logging.getLogger("edgekv.server")

# What a turn yields: None (a step with nothing to report) or (kind, payload) with kind
# "ready" (checks passed, output follows), "delta" (text), "done" (finish and counters).
TurnEvent = tuple[str, object] | None


class RequestError(EdgekvError):
    """A request that cannot be served as asked: an OpenAI-format error with this status."""

    def __init__(self, message: str, *, status: int = 400, code: str | None = None, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.code, self.param, self.kind = status, code, param, kind

    def body(self) -> dict[str, object]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Turn:
    """A parsed, validated request."""

    kind: str  # "chat" or "completion"
    settings: Settings | None  # None: the request chose nothing (continue any, new ones take the defaults)
    rule: BudgetRule | None  # the settings, checked (None with them)
    method: Method | None  # built and checked against the engine by the request handler (None with them)
    max_tokens: int
    sampler: SamplerConfig
    messages: list[dict[str, str]] = field(default_factory=list)
    prompt: str = ""
    stop: tuple[str, ...] = ()


def _claim(store: Store, turn: Turn, rendered: str) -> tuple[Conversation, int]:
    """The conversation this turn continues and where its new text starts: 0 for a new one,
    and for one whose cache was lost (rebuilt from its text, the new prompt included).

    A continuation must diverge from what the cache was fed only inside the last reply (a
    client trimming it); a template that re-renders older turns differently would otherwise
    feed them all again, so such a request starts over."""
    if turn.kind == "chat":
        conv = store.find_chat(turn.messages, turn.settings)
    else:
        conv = store.find_completion(turn.prompt, turn.settings)
    if conv is not None:
        start = common_prefix(conv.text, rendered)
        if start >= len(conv.text) - conv.reply_len:
            conv.busy = True
            return conv, 0 if conv.rebuild else start
    return store.new(turn.kind, turn.settings, turn.rule, turn.method), 0


def run_turn(store: Store, turn: Turn) -> Iterator[TurnEvent]:
    """Claim a conversation, feed what is new, stream the reply, account for it: on the
    session's own steps (``prefill``, ``stream``), one yield per chunk or token. The
    conversation is dropped if the turn fails or is abandoned once its cache was touched
    (its text would be wrong)."""
    model = store.cfg.model
    rendered = model.apply_chat_template(turn.messages, add_assistant=True) if turn.kind == "chat" else turn.prompt
    conv, start = _claim(store, turn, rendered)
    continued = conv.requests > 0  # a known conversation, whether its cache is kept or rebuilt
    touched = finished = False
    try:
        while True:
            try:
                if store.make_live(conv):
                    break
            except EdgekvError as e:
                if conv.file is None:
                    raise
                # its session file no longer loads: rebuild the conversation from its text
                log.warning("conversation %s could not be resumed (%s); rebuilding it from its messages", conv.id, e)
                conv.file.unlink(missing_ok=True)
                conv.file, conv.file_current, conv.rebuild, start = None, False, True, 0
                continue
            yield None  # every live context is busy: wait for a turn to end
        store.touch(conv)
        sess = conv.session
        assert sess is not None
        rebuilt = conv.rebuild
        tokens = model.tokenize(rendered[start:], add_special=start == 0, parse_special=True)
        _check_prompt(store, sess, tokens)
        sess.reset_sampler()  # each request samples from its own seed
        before = (sess.stats.tokens_seen, sess.stats.compressions, sess.stats.tokens_evicted)
        yield ("ready", {"conversation": conv.id, "continued": continued, "rebuilt": rebuilt})
        touched = True
        conv.prefill = (0, len(tokens))
        for progress in sess.prefill(tokens):
            conv.prefill = progress
            yield None
        conv.prefill = None
        # compared with the client's next request: its view, not the cache's (which may hold a
        # little more of the last reply, after a stop string or a trim)
        conv.text = rendered
        reply = Reply()
        for piece in sess.stream(turn.max_tokens, turn.sampler, stop=turn.stop, reply=reply, until_full=True):
            yield ("delta", piece) if piece else None
        sess.settle()  # a lane's last token, decoded with the other lanes': the cache holds the whole reply
        done = _account(store, conv, turn, reply, before, len(tokens), continued)
        done["edgekv"]["rebuilt"] = rebuilt  # its cache was lost (a crash): this turn prefilled it all again
        conv.file_current = conv.rebuild = False  # the cache moved on from any file
        store.commit(conv)  # durable before the reply ends
        finished = True  # the conversation is whole again: free for the next request before the reply is out
        conv.busy = False
        store.want_room(conv)
        yield ("done", done)
    finally:
        if not finished:
            conv.busy = False
            conv.prefill = None
            if touched or not continued:
                store.abandon(conv)


def _check_prompt(store: Store, sess: Session, tokens: list[int]) -> None:
    """The request's new tokens must be some, within the per-request prefill limit, and fit
    (with room to answer) unless the method compresses."""
    cfg = store.cfg
    if not tokens:
        raise RequestError("the request adds nothing to the conversation", param="messages")
    if len(tokens) > cfg.max_prompt_tokens:
        raise RequestError(
            f"the request adds {len(tokens)} prompt tokens; this server prefills at most "
            f"{cfg.max_prompt_tokens} per request (--max-prompt-tokens)", code="prompt_too_long", param="messages")
    if not sess.fits(len(tokens) + 1):
        raise RequestError(
            f"method {sess.method.name!r} keeps every token: {sess.engine.n_cells} cached + {len(tokens)} new "
            f"do not fit in --n-ctx {cfg.n_ctx} with room to answer; choose a compressing method",
            code="context_length_exceeded", param="messages")


def _account(store: Store, conv: Conversation, turn: Turn, reply: Reply, before: tuple[int, int, int],
             n_prompt: int, continued: bool) -> dict[str, object]:
    """Record the reply in the conversation and say what the turn did: the "done" payload."""
    conv.text += reply.text
    conv.reply_len = len(reply.text)
    if turn.kind == "chat":
        conv.messages = [*turn.messages, {"role": "assistant", "content": reply.text}]
    conv.requests += 1
    store.touch(conv)
    cached, compressions0, removed0 = before
    assert conv.session is not None
    stats = conv.session.stats
    removed = stats.tokens_evicted - removed0
    info = store.describe(conv)
    info.update(conversation=conv.id, continued=continued, compressions_this_request=stats.compressions - compressions0,
                evicted=0 if conv.merges else removed, merged=removed if conv.merges else 0)
    for key in ("id", "kind", "state", "live", "events", "prefill", "last_used"):
        info.pop(key, None)
    return {"finish_reason": reply.finish, "content": reply.text, "edgekv": info,
            "usage": {"prompt_tokens": cached + n_prompt, "completion_tokens": reply.tokens,
                      "total_tokens": cached + n_prompt + reply.tokens,
                      "prompt_tokens_details": {"cached_tokens": cached}}}


class Job:
    """One turn in the worker's queue; ``emit`` hands its events to the request's handler."""

    def __init__(self, steps: Iterator[TurnEvent], emit: Callable[[tuple[str, object]], None]) -> None:
        self.steps, self.emit = steps, emit
        self.cancelled = False

    def cancel(self) -> None:
        """The client went away: the worker closes the turn at its next step."""
        self.cancelled = True


class Worker:
    """The one thread that runs llama.cpp for every conversation, a step per turn round-robin."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._jobs: deque[Job] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._current: Job | None = None  # the turn being stepped
        self._making_room = False  # a compression between requests is running (``Store.make_room``)
        self._thread = threading.Thread(target=self._run, name="edgekv-worker", daemon=True)
        self._thread.start()

    def submit(self, turn: Turn, emit: Callable[[tuple[str, object]], None]) -> Job:
        job = Job(run_turn(self.store, turn), emit)
        with self._cv:
            self._jobs.append(job)
            self._cv.notify()
        return job

    @property
    def active(self) -> int:
        """Turns not yet ended: queued, plus the one being stepped. A turn stops counting
        before its last event (done or error) is handed to its client, so a client that
        reads the stats after its reply never sees its own turn still active."""
        with self._cv:
            return len(self._jobs) + (self._current is not None)

    @property
    def idle(self) -> bool:
        """No turn queued or stepped, and no room being made or left to make."""
        with self._cv:
            return not self._jobs and self._current is None and not self._making_room and not self.store.rooms

    def _run(self) -> None:
        while True:
            conv = None
            with self._cv:
                while not self._jobs and not self.store.rooms and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    break
                if self._jobs:
                    job = self._current = self._jobs.popleft()
                else:  # nothing else to do: make room for a conversation whose turn ended
                    conv = self.store.rooms.popleft()
                    self._making_room = True
            if conv is not None:
                try:
                    self.store.make_room(conv)
                except Exception:  # a bug: keep serving, as a failed turn does
                    log.exception("making room failed")
                finally:
                    with self._cv:
                        self._making_room = False
                continue
            last = self._step(job)
            with self._cv:
                self._current = None
                if last is None:
                    self._jobs.append(job)
            if last:
                self._emit(job, last)

    def _step(self, job: Job) -> tuple[str, object] | None:
        """Run one step of a turn; returns None while it goes on, else its last event
        (an empty tuple when there is nothing left to tell)."""
        if job.cancelled:
            job.steps.close()
            return ()
        try:
            event = next(job.steps)
        except StopIteration:
            return ()
        except RequestError as e:
            return ("error", e)
        except EdgekvError as e:
            return ("error", RequestError(str(e)))
        except Exception as e:  # a bug: keep serving the others, report it
            log.exception("turn failed")
            return ("error", RequestError(f"internal error: {type(e).__name__}: {e}", status=500,
                                          kind="server_error"))
        if event is not None and event[0] == "done":
            job.steps.close()  # the turn has accounted for itself; closing runs nothing more
            return event
        if event is not None:
            self._emit(job, event)
        return None

    def _emit(self, job: Job, event: tuple[str, object]) -> None:
        try:
            job.emit(event)
        except RuntimeError:  # the handler's event loop is gone
            job.cancel()

    def close(self) -> None:
        """Stop after the current step; abandoned turns drop their conversations."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout=60)
        for job in self._jobs:
            job.steps.close()
        self._jobs.clear()


__all__ = ["Job", "RequestError", "Turn", "Worker", "run_turn"]
