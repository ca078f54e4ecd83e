"""One module per suite, each exposing ``cases(ctx: Context) -> list[Case]``."""
