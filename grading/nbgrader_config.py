"""nbgrader configuration of the course. grading/course.py points CourseDirectory.root at this folder
(or at a temporary copy, for self-grading and tests)."""

c = get_config()  # noqa: F821 - nbgrader defines it

c.CourseDirectory.course_id = "cs336-parallel"

# Test cells start ranks and run them; a deadlocked exercise fails its own test after
# cs336_parallel.checks.TEST_TIMEOUT_S (30 s). This limit is the backstop for anything else.
c.Execute.timeout = 300
c.Execute.kernel_name = "cs336-parallel"  # registered by `make lab` / `make test`
# nbgrader's default argument, plus: the kernel's start-up notices stay out of the grader's console.
c.Execute.extra_arguments = ["--HistoryManager.hist_file=:memory:", "--IPKernelApp.log_level=ERROR"]

# The stub left in place of every solution.
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}
c.ClearSolutions.text_stub = "YOUR ANSWER HERE"
