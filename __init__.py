"""tensortune: an Ansor-style auto-scheduler run as a Prefect + Dask batch pipeline.

The repository's top-level folders are this package's subpackages (pyproject.toml maps `tensortune` to
the repository root), so the code is imported as `tensortune.codegen`, `tensortune.flows`, ... and never
as bare `codegen` or `flows`, names that belong to unrelated PyPI projects. The layers, one way:

    flows -> storage, codegen, search -> schedule -> tasks
"""
