"""Passes of your own, outside fxmem's canonical order: importing a module here registers its pass (see
docs/writing-a-pass.md)."""
