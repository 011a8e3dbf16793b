"""The course's grading workflow on the command line, one subcommand per step (from the repository root):

    python -m grading release [ASSIGNMENT ...]    # student notebooks -> notebooks/ (from grading/source)
    python -m grading collect DOWNLOADS           # DOWNLOADS/<student>/<assignment>.ipynb -> grading/submitted
    python -m grading autograde [ASSIGNMENT ...]  # every submission in a sandbox, --jobs N at a time;
                                                  # --student S regrades one; scores + report/
    python -m grading feedback [ASSIGNMENT ...]   # one HTML report per student and notebook
    python -m grading export [grades.csv]         # every score, one row per student and assignment;
                                                  # --canvas: in the columns Canvas's gradebook import reads
    python -m grading selfgrade notebooks/01_collectives.ipynb   # a learner grades their own work
    python -m grading student-edition DIR         # the repository a class is given: no solution, no hidden test
    python -m grading gradescope ASSIGNMENT       # autograder.zip, a Gradescope autograder for it

On a cluster (grading/slurm/autograde.sbatch): `prepare`, then one `execute --shard I --shards N` per task of a
Slurm job array, then `merge`, which scores every result into the gradebook and writes the report.

nbgrader keeps its working folders (release/, submitted/, autograded/, feedback/, gradebook.db) in the course
folder; the executed notebooks go to executed/, the class report to report/ (grading/README.md). The work itself
is in gradebook.py (nbgrader and the course folder) and classroom.py (grading a class); this is only its
command line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cs336_parallel import selfcheck
from grading import classroom, edition, gradebook, gradescope, report, runner
from grading.gradebook import COURSE, REPO
from grading.runner import Limits


def _add_limits(parser: argparse.ArgumentParser) -> None:
    defaults = Limits()
    parser.add_argument("--jobs", type=int, default=None,
                        help="notebooks at once (default: 2 x the cores // the notebooks' largest world size)")
    parser.add_argument("--no-sandbox", action="store_true",
                        help="run submissions without a sandbox (only where none can run): as root, they run as "
                             "the unprivileged user cs336-student; otherwise as you, reading and writing what you can")
    parser.add_argument("--time-limit", type=float, default=defaults.wall_s, help="seconds per notebook")
    parser.add_argument("--memory-limit", type=int, default=defaults.memory_mb, help="MB per notebook")
    parser.add_argument("--output-limit", type=float, default=defaults.output_mb, help="MB of output per notebook")


def _limits(args: argparse.Namespace) -> Limits:
    return Limits(wall_s=args.time_limit, memory_mb=args.memory_limit, output_mb=args.output_limit)


def parser() -> argparse.ArgumentParser:
    main_parser = argparse.ArgumentParser(prog="python -m grading", description=__doc__,
                                          formatter_class=argparse.RawDescriptionHelpFormatter)
    main_parser.add_argument("--course", type=Path, default=COURSE, help="the course folder (default: grading/)")
    sub = main_parser.add_subparsers(dest="command", required=True)
    releasing = sub.add_parser("release")
    releasing.add_argument("assignments", nargs="*")
    releasing.add_argument("--force", action="store_true", help="overwrite notebooks that have changes")
    sub.add_parser("collect").add_argument("submissions", type=Path)
    sub.add_parser("prepare").add_argument("assignments", nargs="*")
    grade = sub.add_parser("autograde")
    grade.add_argument("assignments", nargs="*")
    grade.add_argument("--student", action="append", help="regrade this student only (repeatable)")
    grade.add_argument("--force", action="store_true", help="regrade every submission, even those already graded")
    _add_limits(grade)
    shard = sub.add_parser("execute", help="one task of a Slurm job array: execute a share, write no gradebook")
    shard.add_argument("assignments", nargs="*")
    shard.add_argument("--shard", type=int, required=True, help="this task's number, 0..shards-1")
    shard.add_argument("--shards", type=int, required=True, help="how many tasks share the class")
    shard.add_argument("--force", action="store_true", help="execute again what already has a result")
    _add_limits(shard)
    sub.add_parser("merge", help="score the shards' results into the gradebook").add_argument("assignments", nargs="*")
    sub.add_parser("report").add_argument("assignments", nargs="*")
    sub.add_parser("feedback").add_argument("assignments", nargs="*")
    exporting = sub.add_parser("export")
    exporting.add_argument("to", nargs="?", type=Path, default=COURSE / "grades.csv")
    exporting.add_argument("--canvas", action="store_true",
                           help="one row per student, one column per assignment, as Canvas's gradebook import reads")
    sub.add_parser("selfgrade").add_argument("notebook", type=Path)
    sub.add_parser("student-edition", help="write the repository a class is given (no solutions, no hidden tests)"
                   ).add_argument("into", type=Path)
    zipped = sub.add_parser("gradescope", help="write a Gradescope autograder (autograder.zip) for an assignment")
    zipped.add_argument("assignment")
    zipped.add_argument("--out", type=Path, default=Path("autograder.zip"))
    return main_parser


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    root = args.course.resolve()
    names = getattr(args, "assignments", None) or gradebook.assignments(root)
    if args.command == "release":
        try:
            written, refusal = gradebook.release(root, names=args.assignments, force=args.force), None
        except gradebook.LearnerChanges as e:
            written, refusal = e.written, str(e)
        for path in written:
            print(f"wrote {path.relative_to(REPO)}")
        if refusal:
            sys.exit(refusal)
    elif args.command == "collect":
        collected = gradebook.collect(args.submissions, root)
        print(f"collected {len(collected)} notebooks from {len({s for s, _ in collected})} students")
    elif args.command == "prepare":
        gradebook.prepare(names, root)
    elif args.command == "autograde":
        try:
            classroom.autograde(names, root, jobs=args.jobs, students=args.student, force=args.force,
                                limits=_limits(args), use_sandbox=False if args.no_sandbox else None)
        except classroom.Interrupted as e:
            raise SystemExit(str(e)) from None
        print(f"report in {root / 'report'}")
    elif args.command == "execute":
        try:
            classroom.execute_shard(names, root, gradebook.api(root).config, shard=args.shard, shards=args.shards,
                                    parallel=args.jobs, limits=_limits(args),
                                    use_sandbox=classroom.sandbox_wanted(False if args.no_sandbox else None),
                                    results=root / runner.RESULTS, force=args.force)
        except classroom.Interrupted as e:
            raise SystemExit(str(e)) from None
    elif args.command == "merge":
        print(f"scored {classroom.merge(names, root)} notebooks; report in {root / 'report'}")
    elif args.command == "report":
        print(f"report in {report.write(names, root)}")
    elif args.command == "feedback":
        gradebook.feedback(args.assignments, root)
        print(f"feedback in {root / 'feedback'}")
    elif args.command == "export":
        print(f"wrote {report.canvas(args.to, root) if args.canvas else gradebook.export(args.to, root)}")
    elif args.command == "student-edition":
        written = edition.write(args.into.resolve(), root)
        print(f"wrote {len(written)} files into {args.into}: the student edition (no solution, no hidden test)")
    elif args.command == "gradescope":
        print(f"wrote {gradescope.build(args.assignment, args.out, root)}: upload it as the assignment's autograder")
    else:
        print("\n".join(selfcheck.table(classroom.selfgrade(args.notebook))))
