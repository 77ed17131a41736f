"""Where Ray's and Tune's own terminal output goes when fedray keeps the terminal for itself: a file."""

from __future__ import annotations

import logging
import re

import ray


class _PlainText:
    """A text file that drops the terminal colour codes Ray puts in the lines it forwards."""

    ANSI = re.compile(r"\x1b\[[0-9;]*m")

    def __init__(self, file):
        self.file = file

    def write(self, text: str) -> int:
        return self.file.write(self.ANSI.sub("", text))

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class RayLogFile:
    """Sends what Ray and Tune would print on the driver's terminal to a file instead: the lines its workers
    forward (``log_to_driver``; every actor's and trial's prints and Ray's warnings from them) and the
    Python loggers ``ray.*``. Undone by :meth:`close`. Ray's C++ core on the driver still writes to stderr:
    that happens only when something goes wrong."""

    HANDLER = "ray_print_logs"  # the name Ray gives its own terminal handler

    def __init__(self, path):
        from functools import partial

        from ray._private import ray_logging
        from ray._private.worker import print_worker_logs

        self.path = path
        self.file = _PlainText(open(path, "a", buffering=1))
        self.dispatcher = ray_logging.global_worker_stdstream_dispatcher
        self.dispatcher.remove_handler(self.HANDLER)
        self.dispatcher.add_handler(self.HANDLER, partial(print_worker_logs, print_file=self.file))
        self.handler = logging.StreamHandler(self.file)
        self.handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self.loggers = {name: logging.getLogger(name) for name in ("ray", "ray.tune", "ray.train", "ray.air")}
        self.saved = {name: (lg.handlers[:], lg.propagate) for name, lg in self.loggers.items()}
        for lg in self.loggers.values():
            lg.handlers, lg.propagate = [self.handler], False

    def close(self) -> None:
        from functools import partial

        from ray._private.worker import print_to_stdstream

        for name, (handlers, propagate) in self.saved.items():
            self.loggers[name].handlers, self.loggers[name].propagate = handlers, propagate
        self.dispatcher.remove_handler(self.HANDLER)
        if ray.is_initialized():
            self.dispatcher.add_handler(self.HANDLER, partial(print_to_stdstream, ignore_prefix=False))
        self.file.close()
