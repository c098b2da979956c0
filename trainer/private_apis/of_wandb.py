"""wandb's and wandb-workspaces' private APIs (the table in trainer/private_apis/__init__.py);
checked against wandb 0.31.0 and wandb-workspaces 0.4.13. Imported by the job process only."""

from __future__ import annotations

from typing import Any


def generate_run_id() -> str:
    """A new W&B run id, as wandb makes them."""
    from wandb.sdk.lib.runid import generate_id

    return generate_id()


def service_lost_errors() -> tuple[type[BaseException], ...]:
    """What a wandb call raises once its service process is gone, by when the call meets the loss:
    the socket's write (ConnectionError and its subclasses: reset, broken pipe), the closed mailbox
    (MailboxClosedError) or a request whose answer will never come (HandleAbandonedError)."""
    from wandb.sdk.mailbox import HandleAbandonedError, MailboxClosedError

    return (ConnectionError, MailboxClosedError, HandleAbandonedError)


def report_json(report: Any) -> str:
    """A wandb-workspaces Report's serialised form: the ReportViewspec the library sends on save."""
    return report._to_model().model_dump_json(by_alias=True, exclude_none=True, indent=1)


def report_from_json(text: str) -> Any:
    """`report_json`'s output back as a Report, with the library's own loader."""
    import wandb_workspaces.reports.v2 as wr
    from wandb_workspaces.reports.v2.internal import ReportViewspec

    return wr.Report._from_model(ReportViewspec.model_validate_json(text))
