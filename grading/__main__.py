"""`python -m grading ...`: the course's grading workflow (grading/course.py)."""

from grading.course import main

main()
