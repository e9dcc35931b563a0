"""The Slurm tests skip, as a whole, where no Slurm cluster can start (no
packages, or daemons that refuse to run): pytest then exits with 77, which
ctest reports as skipped (tests/slurm/CMakeLists.txt), with the reason in the
output."""

import test_slurm


def pytest_sessionfinish(session, exitstatus):
    if test_slurm.UNAVAILABLE and exitstatus == 0:
        print("\nskipped: no Slurm cluster could start here: %s" % test_slurm.UNAVAILABLE[0])
        session.exitstatus = 77
