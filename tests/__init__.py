"""omni-serve tests: tests/<area>/test_<thing>.py mirror the layout; tests/stacks.py starts the real stack."""
