"""What torch prints while it exports a model, kept off the terminal; on failure, in a file the error names.

torch.export prints the partial graph of a failed export to stderr (hundreds of lines) and logs warnings through
torch's own stream handlers. `export_output_kept` collects both while one export runs: on success the text goes to
stderr as it would have (the model's own prints, torch's warnings), on failure it becomes the CaptureError's
`details`, which `write_details` puts in a file so that the error itself stays one line.

    with export_output_kept() as output:
        ep = torch.export.export(...)        # on success: output.replay()
    error.details = output.details(exc)     # on failure
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
import tempfile
import traceback


class ExportOutput:
    """The text written to stderr and to torch's log handlers while an export ran."""

    def __init__(self):
        self.buffer = io.StringIO()

    def replay(self) -> None:
        """Write what was kept to stderr (an export that succeeded: its output as it would have been)."""
        text = self.buffer.getvalue()
        if text:
            sys.stderr.write(text)

    def details(self, error: BaseException) -> str:
        """The full error (every exception in its chain, with tracebacks) and the output kept."""
        text = "".join(traceback.format_exception(error))
        printed = self.buffer.getvalue().strip()
        if printed:
            text += "\n\nwhat torch printed while exporting (the partial graph of a failed export):\n\n" + printed
        return text + "\n"


def _torch_stream_handlers() -> list[logging.StreamHandler]:
    """torch's handlers that write to a console stream (torch sets one on each of its loggers, which do not
    propagate to the root); not files, nor handlers without a stream yet (torch's trace handler)."""
    handlers = []
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if not isinstance(logger, logging.Logger) or not (name == "torch" or name.startswith("torch.")):
            continue
        handlers.extend(h for h in logger.handlers if type(h) is logging.StreamHandler and h.stream is not None)
    return handlers


@contextlib.contextmanager
def export_output_kept():
    """stderr and torch's log handlers write into an `ExportOutput` while inside."""
    output = ExportOutput()
    swapped = []
    try:
        for handler in _torch_stream_handlers():
            swapped.append((handler, handler.stream))
            handler.setStream(output.buffer)
        with contextlib.redirect_stderr(output.buffer):
            yield output
    finally:
        for handler, stream in swapped:
            handler.setStream(stream)


def write_details(model_name: str, header: str, details: str) -> str:
    """Write `details` under a one-line `header` to a new file in the temp directory; its path."""
    safe = re.sub(r"[^0-9A-Za-z_.-]", "_", model_name)[:64] or "model"
    handle, path = tempfile.mkstemp(prefix=f"fxmem-capture-{safe}-", suffix=".txt")
    with os.fdopen(handle, "w", encoding="utf-8") as file:
        file.write(header + "\n\n" + details)
    return path
