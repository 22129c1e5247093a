"""A progress bar on stderr: redrawn in place on a terminal, one line per finished block otherwise."""

from __future__ import annotations

import sys
import threading
import time


class Progress:
    def __init__(self, total: int, stream=None, width: int = 28):
        self.total = max(total, 1)
        self.stream = stream or sys.stderr
        self.width = width
        self.done = 0
        self.label = ""
        self.started = time.monotonic()
        self.block_started = self.started
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._lock = threading.Lock()  # client threads advance it

    def begin(self, label: str) -> None:
        with self._lock:
            self.label = label
            self.block_started = time.monotonic()
            self._draw()

    def advance(self, n: int = 1) -> None:
        with self._lock:
            self.done = min(self.done + n, self.total)
            self._draw()

    def end_block(self) -> None:
        with self._lock:
            if not self.tty:
                self.stream.write(f"{self._line()}  ({time.monotonic() - self.block_started:.1f} s)\n")
                self.stream.flush()

    def note(self, message: str) -> None:
        """A line above the bar (start-up steps, skips)."""
        with self._lock:
            self.stream.write(("\r\x1b[2K" if self.tty else "") + message + "\n")
            self._draw()

    def close(self) -> None:
        with self._lock:
            if self.tty:
                self.stream.write("\r\x1b[2K")
                self.stream.flush()

    def _line(self) -> str:
        filled = int(self.width * self.done / self.total)
        elapsed = int(time.monotonic() - self.started)
        bar = "#" * filled + "." * (self.width - filled)
        return f"[{bar}] {self.done:>4}/{self.total} {elapsed // 60:02d}:{elapsed % 60:02d} {self.label}"

    def _draw(self) -> None:
        if self.tty:
            self.stream.write("\r\x1b[2K" + self._line())
            self.stream.flush()
