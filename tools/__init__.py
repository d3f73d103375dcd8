"""Tools for kernel developers: GPU check, memcheck cases, provenance, profiling (run as ``python -m tools.<name>``)."""
