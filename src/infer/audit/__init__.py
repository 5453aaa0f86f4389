"""``infer audit``: statistical and greedy checks that speculative decoding is lossless on a user's models."""

from infer.audit.checks import AuditSettings, exit_code, run_audit

__all__ = ["AuditSettings", "exit_code", "run_audit"]
