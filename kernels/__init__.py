"""The kernels: one interface (backend.py), torch for the CPU (attention.py, rowwise.py), Triton for GPUs
(triton_attention.py, triton_rowwise.py), and the contract they share with the engine (contract.py).
Installed as tfq.kernels; nothing here imports the rest of tfq."""
import sys as _sys

if __name__ == "kernels":  # this folder imported by its own name (the repository's root on sys.path), not as
    # tfq.kernels: where a package named kernels is installed (HF's kernel hub, which transformers imports), that
    # is what `import kernels` means there, so it takes this module's place (a module may replace itself in
    # sys.modules while it is imported; the import returns the replacement)
    from importlib.machinery import PathFinder as _PathFinder
    from importlib.util import module_from_spec as _module_from_spec
    from os.path import abspath as _abspath
    from os.path import dirname as _dirname

    _root = _dirname(_dirname(_abspath(__file__)))
    _spec = _PathFinder.find_spec("kernels", [p for p in _sys.path if _abspath(p or ".") != _root])
    if _spec is not None:
        _installed = _module_from_spec(_spec)
        _sys.modules["kernels"] = _installed
        _spec.loader.exec_module(_installed)
