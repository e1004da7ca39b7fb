"""User-facing errors. Each names what is wrong and where; the CLI prints the message and exits."""


def first_line(text: str | None) -> str:
    """The first line of `text` without the whitespace around it, "" when there is none: how a message quotes
    another error's (possibly long, multi-line) text."""
    lines = (text or "").strip().splitlines()
    return lines[0] if lines else ""


class FxmemError(Exception):
    """Base of fxmem's user-facing errors. `exit_code` is what the CLI returns."""
    exit_code = 2


class CaptureError(FxmemError):
    """The model could not be captured. `details`: torch's full error text, traceback and the output export printed
    (a partial graph), too long for one line: `capture` writes it to a file the message names."""
    details: str | None = None


class InputShapeError(FxmemError): ...


class PolicyError(FxmemError): ...


class ModelFileError(FxmemError): ...


class LossFnError(ModelFileError):
    """The model file's `loss_fn` raised, has the wrong signature or returned something that is not a loss a training
    step can use: the user's error, wherever in fxmem the loss was computed (cost model, measurement, a pass)."""


class BudgetError(FxmemError):
    """A required budget is out of reach. `lowest`: the lowest peak (or activations) in bytes the raising step
    reaches, when it knows it (the checkpoint pass raises the lowest of its plans' errors)."""
    lowest: int | None = None


class StrictError(FxmemError):
    """`strict=True` (`--strict`) refused a result the run would otherwise have written and reported: neither a
    user error in the input nor an internal error, so the CLI gives it an exit code of its own."""
    exit_code = 3


class PassError(StrictError):
    """strict: a pass failed or was rolled back."""


class StrictBudgetError(BudgetError, StrictError):
    """strict: the result is over its budget."""
    exit_code = 3
