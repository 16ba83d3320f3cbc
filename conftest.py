"""Root pytest configuration: doctests run over the packages, except the CLI entry point."""

collect_ignore = ["hpml_compile/__main__.py", "benchmarks", "notebooks", "build", "out"]
