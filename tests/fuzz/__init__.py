"""Coverage-guided fuzzing (atheris, libFuzzer's engine for Python) of the
parsers that read untrusted bytes: the qcow2 header, a qcow2 image's
metadata as a whole, the qcow2 snapshot table and the serve config file.

One module per target (``fuzz_<target>.py``) holds its ``one_input``; the
seed and grown corpus lives in ``corpus/<target>/``; ``run.py`` runs a
target (``python -m tests.fuzz.run TARGET``). The contract each target
checks: whatever the input, the parser returns or raises the project's own
one-line error (``aioublk.errors.Error``), never another exception, a hang
or unbounded memory. tests/fuzz/test_fuzz.py runs each target briefly, with a
fixed seed, over the kept corpus.
"""
