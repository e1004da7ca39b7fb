"""fxmem's passes, one file per pass (installed as `fxmem.passes`).

Canonical order: attention, pruning, gating, precision, checkpoint, offload. Each module registers its pass with
`fxmem.pass_api.register`; `fxmem.registry.load_passes()` imports the ones that exist.
"""
