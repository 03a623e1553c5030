"""Lightning adapter tests: a test file per lightning_ext module with behaviour; shared models in helpers/."""
