"""Progress inside one long sequence: which layer the forward pass has reached.

Every long command shows progress across sequences; one long sequence is one step, and on a CPU a step can take
minutes (`ablate --method streaming --split file` printed nothing for 9.8 minutes). `watching` registers a forward
hook on each layer's attention module (model.attention_modules, the project's one way to find the layers) for the
length of a `with` block, and hands `Within(layer done, layers, pass, passes)` to a callback as the layers finish,
at most every EVERY_SECONDS (the last layer always). Sequences of LONG_TOKENS or fewer register no hook at all: short
sentences run exactly as before.

The library passes the callback on: `reporter(progress, *args)` makes one from a command's own progress callback
when that callback takes a `within` keyword (the CLI's do: `stage_progress`, `analyze`'s bar), and gives None
otherwise, so a callback written for (stage, done, total) sees only those calls. `Shown` is the CLI's side: a
Within as words for a progress bar ("sequence 1/1, layer 12/30") and, where stderr is no terminal, a plain line at
most every LOG_EVERY_SECONDS (for analyze's short sentences too, which report no layers).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

LONG_TOKENS = 1024  # sequences longer than this report their layers; shorter ones register no hook
EVERY_SECONDS = 0.25  # at most one report per this many seconds (the last layer of the last pass always)
LOG_EVERY_SECONDS = 10.0  # off a terminal: at most one line per this many seconds within a sequence


@dataclass(frozen=True)
class Within:
    """How far the forward pass over one sequence (or batch) is: `layer` of `layers` done in pass `run` of
    `runs` (a command that runs the same batch several times, e.g. once per mask, counts passes)."""

    layer: int  # layers done in this pass, 1..layers
    layers: int
    run: int = 1  # the pass under way, 1..runs
    runs: int = 1
    rows: int = 1  # sequences in the batch

    @property
    def done(self) -> bool:
        """The last layer of the last pass: the sequence is through."""
        return self.layer >= self.layers and self.run >= self.runs

    def __str__(self) -> str:
        step = f"layer {self.layer}/{self.layers}"
        return step if self.runs == 1 else f"pass {self.run}/{self.runs}, {step}"


OnLayer = Callable[[Within], None]


def layer_modules(model: Any) -> list[Any]:
    """The model's attention modules in layer order: a hook on each fires as its layer's attention is done."""
    from attnprobe.model import attention_modules

    return [module for module, _ in attention_modules(model)]


@contextmanager
def watching(model: Any, tokens: int, on_layer: OnLayer | None, *, runs: int = 1, rows: int = 1,
             min_tokens: int | None = None, every: float | None = None,
             clock: Callable[[], float] = time.monotonic) -> Iterator[None]:
    """Within the block, report each layer of `model` done to `on_layer` while it runs a sequence (or a batch of
    `rows`) of `tokens` tokens (the padded length), over `runs` forward passes; nothing at all (no hook) when
    `on_layer` is None or `tokens` is `min_tokens` (LONG_TOKENS) or fewer. Reports come at most every `every`
    (EVERY_SECONDS) seconds, and the last layer of the last pass always (Within.done), so a display can drop the
    detail once the sequence is through: where the forward stops inside the last layer (analysis stops after its
    attention, and the hook on it never fires), or makes fewer passes than `runs`, that report comes as the block
    ends. The hooks are removed when the block ends, however it ends."""
    if on_layer is None or tokens <= (LONG_TOKENS if min_tokens is None else min_tokens):
        yield
        return
    modules = layer_modules(model)
    if not modules:  # no layer found: no detail, the command runs as ever
        yield
        return
    layers, every = len(modules), EVERY_SECONDS if every is None else every
    state: dict[str, Any] = {"run": 0, "last": -1, "reported": None, "done": False}

    def hook_for(index: int) -> Callable[..., None]:
        def hook(_module: Any, _args: Any, _output: Any) -> None:
            if index <= state["last"] or state["run"] == 0:  # the first layer again: a new pass
                state["run"] += 1
            state["last"] = index
            within = Within(index + 1, layers, state["run"], max(runs, state["run"]), rows)
            now = clock()
            if within.done or state["reported"] is None or now - state["reported"] >= every:
                state["reported"], state["done"] = now, within.done
                on_layer(within)

        return hook

    handles = [module.register_forward_hook(hook_for(index)) for index, module in enumerate(modules)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
    if state["run"] and not state["done"]:  # the pass stopped inside its last layer (analysis's LastLayerDone)
        passes = max(runs, state["run"])
        on_layer(Within(layers, layers, passes, passes, rows))


def takes_within(callback: Callable[..., Any]) -> bool:
    """Whether `callback` accepts a `within` keyword (or any keyword)."""
    try:
        parameters = inspect.signature(callback).parameters.values()
    except (TypeError, ValueError):  # a builtin such as list.append
        return False
    return any(p.name == "within" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
               or p.kind == p.VAR_KEYWORD for p in parameters)


def reporter(progress: Callable[..., Any] | None, *args: Any) -> OnLayer | None:
    """An OnLayer that calls `progress(*args, within=...)`, where `progress` takes a `within` keyword; else None
    (no hook is registered, and `progress` sees only its usual calls)."""
    if progress is None or not takes_within(progress):
        return None
    return lambda within: progress(*args, within=within)


class Shown:
    """The CLI's side: a Within as words next to a bar, or off a terminal as a plain line (at most every
    `every` seconds within a sequence; a step line, without Within, always)."""

    def __init__(self, unit: str, every: float | None = None, clock: Callable[[], float] = time.monotonic,
                 log: Callable[[str], None] | None = None):
        self.unit = unit  # what the bar counts, plural: "sentences", "sequences", "trials"
        self.every = LOG_EVERY_SECONDS if every is None else every
        self.clock, self.log = clock, log  # log: where `advance` prints its lines (off a terminal)
        self.started = self.printed = clock()
        self.first: int | None = None  # the first sequence of the batch under way (the count moves within it)

    def advance(self, bar: Any, task: Any, step: float, within: Within | None = None) -> None:
        """`analyze`'s bar (a rich Progress and its task): advance by `step` sentences; with a Within, name the
        sequence and layer in the task's description; hand `log` a line when one is due (every `every` seconds:
        short sentences, which come without a Within, too, so a log is never silent for long)."""
        bar.advance(task, step)
        if within is None and (self.log is None or self.clock() - self.printed < self.every):
            return
        found = next(t for t in bar.tasks if t.id == task)
        if within is None:
            if int(found.completed) > int(found.completed - step):  # a sentence is through (steps are layers' shares)
                self.log(self.line("analyze", found.completed, found.total))
            return
        bar.update(task, description=self.description(self.unit, found.completed, found.total, within))
        line = self.line("analyze", found.completed, found.total, within) if self.log is not None else None
        if line is not None:
            self.log(line)

    def words(self, done: float, total: int | float | None, within: Within | None) -> str:
        """'sequence 1/1, layer 12/30' ('sequences 9-16/40, ...' for a batch): the sequences under way (from `done`
        when the batch's first report came) and the layer; '' without a Within or once done."""
        if within is None or within.done:
            self.first = None
            return ""
        if self.first is None:
            self.first = int(done) + 1
        last = self.first + within.rows - 1
        first, last = (min(self.first, int(total)), min(last, int(total))) if total else (self.first, last)
        noun = self.unit[:-1] if self.unit.endswith("s") and last == first else self.unit
        span = f"{first}" if last == first else f"{first}-{last}"
        return f"{noun} {span}{f'/{int(total)}' if total else ''}, {within}"

    def description(self, stage: str, done: float, total: int | float | None, within: Within | None) -> str:
        """A bar's description: `stage`, and the words while a long sequence is under way."""
        words = self.words(done, total, within)
        return f"{stage}: {words}" if words else stage

    def line(self, stage: str, done: float, total: int | float | None, within: Within | None = None) -> str | None:
        """The plain line for a step ("stage: 3/8 sentences (12.0 s)"), or within a sequence ("stage: 0/1
        sequences, sequence 1/1, layer 12/30 (12.0 s)") when `every` seconds have passed since the last line; None
        when nothing is to be printed."""
        now = self.clock()
        words = self.words(done, total, within)
        if within is not None and (not words or now - self.printed < self.every):
            return None
        self.printed = now
        of = f"/{int(total)}" if total else ""
        return f"{stage}: {int(done)}{of} {self.unit}{', ' + words if words else ''} ({now - self.started:.1f} s)"
