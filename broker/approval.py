"""Where the documentation says the library's approve and deny are: they now live with the other
operations in ``shared/operations.py``; re-exported here so that ``from runbrake.broker.approval import
approve_run`` keeps working."""

from runbrake.shared.operations import Decision, approve_run, deny_run

__all__ = ["Decision", "approve_run", "deny_run"]
