"""What a preparation tells its user on stderr: a progress bar (documents, tokens per second, and an ETA by the
bytes on disk consumed, on a terminal only) and one line when data.max_bytes cut the corpus. Bytes on disk are
compared with bytes on disk (a .jsonl.gz's compressed bytes), text with text: the bar reaches its end with the
corpus's, whatever the JSON or compression around the text."""

from __future__ import annotations

import sys
import time

from .corpus import Corpus

__all__ = ["PreparationBar", "say_if_truncated"]

_REFRESH_S = 0.5


class PreparationBar:
    """A tqdm bar over the corpus's bytes on disk (its ETA) with documents and tokens per second; nothing without
    tqdm or a terminal. `update` after each document written; a resume starts it at `disk_done`."""

    def __init__(self, corpus: Corpus, documents_done: int = 0, disk_done: int = 0) -> None:
        self.corpus, self.documents, self.tokens = corpus, documents_done, 0
        self._start = self._shown = time.perf_counter()
        try:
            from tqdm import tqdm
        except ImportError:
            self._bar = None
            return
        self._bar = tqdm(total=corpus.disk_bytes, initial=disk_done, desc="preparing", unit="B", unit_scale=True, file=sys.stderr,
                         disable=None, dynamic_ncols=True)

    def update(self, num_tokens: int) -> None:
        self.documents += 1
        self.tokens += num_tokens
        if self._bar is not None and not self._bar.disable and time.perf_counter() - self._shown >= _REFRESH_S:
            self._show()

    def _show(self) -> None:
        self._shown = now = time.perf_counter()
        self._bar.update(self.corpus.disk_read - self._bar.n)
        self._bar.set_postfix_str(f"{self.documents:,} docs, {self.tokens / max(now - self._start, 1e-9):,.0f} tok/s",
                                  refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            if not self._bar.disable:
                self._show()  # the last figures
            self._bar.close()


def say_if_truncated(corpus: Corpus) -> None:
    """One line on stderr when `max_bytes` cut the corpus: the text read, the share of the corpus on disk it came
    from, the text the whole corpus holds at that rate, and how to take it all."""
    if corpus.truncated:
        read, disk = corpus.disk_read, corpus.disk_bytes
        text = corpus.stats.num_bytes
        whole = f"; at that rate it holds about {text * disk / read / 1e6:.1f} MB of text" if read else ""
        print(f"data.max_bytes={corpus.max_bytes} cut the corpus: read {text / 1e6:.1f} MB of text from the first "
              f"{read / 1e6:.1f} MB of its {disk / 1e6:.1f} MB on disk ({100 * read / max(disk, 1):.0f} %) in "
              f"{corpus.source}{whole}; to take all of it, pass --max-bytes none (in a config: data.max_bytes: null)",
              file=sys.stderr, flush=True)
