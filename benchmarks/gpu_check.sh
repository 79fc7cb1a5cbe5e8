#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py; its docstring says what each figure should be).
# PYTHON picks the interpreter: the project's venv here, e.g. PYTHON=python3 on a GPU machine.
exec "${PYTHON:-.venv/bin/python}" benchmarks/gpu_check.py "$@"
