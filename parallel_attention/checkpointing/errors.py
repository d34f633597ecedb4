"""The two errors a checkpoint load raises (its own module so that `format` and `compatibility` both raise them)."""


class CheckpointError(ValueError):
    """This checkpoint cannot be used by this run; the message says what differs."""


class CheckpointCorruptError(CheckpointError):
    """Files are missing, truncated or altered: an older checkpoint may still be good."""
