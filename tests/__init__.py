"""The test suite as one package: its modules import as tests.<dir>.<module>, so a test folder such as
tests/kernels never stands in for a top-level package of the same name (transformers imports the
`kernels` distribution it now depends on)."""
