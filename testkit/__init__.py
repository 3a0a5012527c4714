"""Helpers of the tests and the benches: plain functions and context managers, no pytest fixtures.

    wait       wait_until: the one way a test waits for a condition
    processes  free ports, the processes a test started (found by their data dir) and their cleanup
    runs       fabricated plans and run folders, written through the executor's own store API
    dashboard  the real dashboard (streamlit) on a free port, and headless Chromium to drive it
    postgres   a PostgreSQL server of our own (Debian's binaries) for a block
    slurm      a two-node SLURM cluster on this machine (network namespaces) for a block
    roofline   published GPU throughput figures the roofline estimate is checked against

Development only: not installed with the package. The pytest fixtures that wrap these live in
tests/conftest.py; bench/ imports testkit, never tests/. See docs/ARCHITECTURE.md (layers).
"""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
