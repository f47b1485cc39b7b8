"""A pytest plugin (used by conftest.py; ``-p xdist_crash_once`` elsewhere): a test whose
pytest-xdist worker crashed fails once instead of hanging the run.

xdist's file scheduling puts the crashed test back with the rest of its file, so a crash that
repeats (a SIGILL from code built for another CPU) kills every replacement worker in turn; past
the restart limit the controller and the workers waited on each other until CI's time limit. Here
the crashed test is marked done (xdist reports it failed, naming the worker and the test) and only
the rest of its file is scheduled again.
"""


def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's file scheduling, with a crashed test failed once (see the module)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class CrashOnceScheduling(LoadFileScheduling):
        def remove_node(self, node):
            workload = self.assigned_work.pop(node)
            pending = [(scope, nodeid) for scope, unit in workload.items()
                       for nodeid, done in unit.items() if not done]
            if not pending:
                return None
            scope, crashed = pending[0]  # a worker runs its file's tests in order
            workload[scope][crashed] = True  # reported failed by the caller, never rerun
            self.workqueue.update({s: u for s, u in workload.items() if not all(u.values())})
            for other in self.assigned_work:
                self._reschedule(other)
            return crashed

    return CrashOnceScheduling(config, log)
