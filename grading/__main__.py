"""`python -m grading ...`: the course's grading workflow (grading/cli.py)."""

from grading.cli import main

main()
