"""How kvturn's processes log: one record, one line. A message formats what clients send (a peer's address from
kv_transfer_params, a URL path, a conversation id); a newline or another control character in it would let a client
write a line of its own into the log, looking like any other. Such characters are written escaped (`\\n`), in every
message of every logger; a traceback, which the logging module appends after the message, keeps its lines."""
import logging
import re

FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _escaped(match: re.Match) -> str:
    return match.group().encode("unicode_escape").decode("ascii")


def one_line(text: str) -> str:
    """`text` with its control characters escaped: `\\n`, `\\x1b`, ..."""
    return _CONTROL.sub(_escaped, text)


class OneLineFormatter(logging.Formatter):
    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = one_line(record.message)
        return super().formatMessage(record)


def setup(level: str) -> None:
    """Log at `level` to stderr, one line per record."""
    handler = logging.StreamHandler()
    handler.setFormatter(OneLineFormatter(FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler])
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per upstream call drowns what matters
