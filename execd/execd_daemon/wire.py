"""What every route shares: the error a route raises for a status code, numbers and JSON as they
cross the wire, and the token generation a request was authorized under."""

import threading


class HTTPError(Exception):
    def __init__(self, code, message, extra=None):
        Exception.__init__(self, message)
        self.code = code
        self.message = message
        self.extra = extra or {}


# The token generation the current request was authorized under (None: a public route).
_REQ = threading.local()


def still_authorized(d):
    """Refuse an action of a request authorized with a token rotated since: when a grading pod
    changes holders, the last holder's request in flight (a slow body, a wait on a lock) must
    not act after /restore and /diff said clean. Called when the body is complete and again
    under the lock /restore also takes, so an action runs wholly before the restore or not."""
    gen = getattr(_REQ, "gen", None)
    if gen is not None and gen != d.token_gen:
        raise HTTPError(401, "the token this request was authorized with has been rotated",
                        {"close_body": True})


def wire_uint(value, cap):
    """A number taken from the wire: 1*DIGIT of ASCII digits, SP/HTAB around it allowed;
    min(value, cap + 1), or None when it is not that. str.isdigit, int() and regex \\d also
    take superscripts, other scripts' digits, signs, underscores and Unicode spaces, and int()
    refuses over 4300 digits."""
    s = value.strip(" \t")
    if not s or s.strip("0123456789"):
        return None
    s = s.lstrip("0") or "0"
    if len(s) > len(str(cap)):
        return cap + 1
    return min(int(s), cap + 1)


def json_bytes(obj):
    import json  # by the first reply, not at start (the imports at the top say why)

    return json.dumps(obj, separators=(",", ":")).encode()
