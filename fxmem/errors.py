"""User-facing errors. Each names what is wrong and where; the CLI prints the message and exits."""


class FxmemError(Exception):
    """Base of fxmem's user-facing errors. `exit_code` is what the CLI returns."""
    exit_code = 2


class CaptureError(FxmemError): ...


class InputShapeError(FxmemError): ...


class PolicyError(FxmemError): ...


class ModelFileError(FxmemError): ...


class BudgetError(FxmemError): ...


class PassError(FxmemError):
    exit_code = 1
