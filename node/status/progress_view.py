"""Showing a join's progress (`node.status.progress.JoinProgress`): a rich live line on a terminal, plain log lines
otherwise (one per phase change, then one every `log_every_s` while training), nothing with `--quiet`
(`progress = false`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import Callable
from typing import IO, Any

from node.status.progress import FAILED, JoinProgress, render_line

logger = logging.getLogger("node.progress")


class ProgressView:
    """Draws `progress`; `tty=None` asks the stream. Call `refresh()` after changes, `close()` at the end."""

    def __init__(
        self,
        progress: JoinProgress,
        *,
        stream: IO[str] | None = None,
        tty: bool | None = None,
        log_every_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.progress = progress
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.log_every_s = log_every_s
        self.clock = clock
        self._seen_changes = -1
        self._logged_at = -float("inf")
        self._live: Any = None
        self.lines: list[str] = []  # what the plain view logged (tests read it)
        progress.listeners.append(
            self.refresh
        )  # every phase shown, even those shorter than the redraw period

    def refresh(self) -> None:
        line = render_line(self.progress.snapshot())
        if self.tty:
            self._draw(line)
            return
        changed = self.progress.changes != self._seen_changes
        due = self.progress.phase == "training" and self.clock() - self._logged_at >= self.log_every_s
        if changed or due:
            self._seen_changes, self._logged_at = self.progress.changes, self.clock()
            self.lines.append(line)
            (logger.error if self.progress.phase == FAILED else logger.info)("progress: %s", line)

    def _draw(self, line: str) -> None:
        from rich.console import Console
        from rich.live import Live

        failed = self.progress.phase == FAILED
        style = "bold red" if failed else "cyan"
        if self._live is None:
            console = Console(file=self.stream, highlight=False)
            self._live = Live(
                _one_line(line, style, whole=failed), console=console, auto_refresh=False, transient=False
            )
            self._live.start()
        self._live.update(_one_line(line, style, whole=failed), refresh=True)

    def close(self) -> None:
        self.refresh()
        if self._live is not None:
            self._live.stop()
            self._live = None

    async def run(
        self, stop: asyncio.Event, status: Callable[[], dict[str, Any]], period_s: float = 1.0
    ) -> None:
        """Until `stop`: feed the node's status to the progress and redraw, every `period_s`."""
        while not stop.is_set():
            try:
                document = status()
            except Exception as e:  # a role's status() failing must not end the node: the view just skips it
                logger.debug("progress: status unavailable: %r", e)
                document = {}
            if document:
                self.progress.observe(document)
            self.refresh()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), period_s)


def _one_line(line: str, style: str, *, whole: bool = False) -> Any:
    """The live line, cut to the terminal's width (a wrapped live line leaves copies of itself behind); `whole`:
    the last line, a failure and what to do next, is shown in full."""
    from rich.text import Text

    if whole:
        return Text(line, style=style)
    return Text(line, style=style, no_wrap=True, overflow="ellipsis")
