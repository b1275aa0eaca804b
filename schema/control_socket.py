"""A worker's control socket (ControlRequest and ControlReply in schema/admin.proto): one message
a frame, for the front end that asks and the worker that answers.

A request is one of the verbs' own message types (pb.WorkerCheckpointRequest, pb.PaceRequest,
...), a reply's value one of the results' (pb.CheckpointResult, pb.RestoreReply, pb.CtxStats,
pb.CheckpointProgress), the packed ImageDelta (bytes) of a checkpoint with `early`, None for
done, or a failure's (status, message).
"""
from google.protobuf.message import DecodeError

from phos.schema import admin_pb2 as pb

MAX_FRAME = 1 << 20      # a control message carries no bulk bytes: a bigger one is refused unread
MALFORMED = (DecodeError, ValueError)


def _members(message, oneof):
    """{message type's full name: field} of a oneof's members."""
    return {f.message_type.full_name: f.name for f in message.DESCRIPTOR.oneofs_by_name[oneof].fields
            if f.message_type is not None}


VERBS = _members(pb.ControlRequest, "verb")          # the request's type names its verb
OUTCOMES = _members(pb.ControlReply, "outcome")


def request_frame(seq, request):
    """A ControlRequest frame of one verb's request message."""
    verb = VERBS.get(type(request).DESCRIPTOR.full_name)
    if verb is None:
        raise ValueError(f"{type(request).__name__} is no control request")
    return pb.ControlRequest(seq=seq, **{verb: request}).SerializeToString()


def read_request(frame):
    """(seq, verb, the verb's request message) of a ControlRequest frame; verb None where the
    frame names none. Raises one of MALFORMED."""
    req = _parse(pb.ControlRequest, frame)
    verb = req.WhichOneof("verb")
    return req.seq, verb, getattr(req, verb) if verb else None


def reply_frame(seq, value=None):
    """A ControlReply frame: value as the module's docstring says."""
    reply = pb.ControlReply(seq=seq)
    if value is None:
        reply.done.SetInParent()
    elif isinstance(value, bytes):
        reply.delta = value
    elif isinstance(value, tuple):
        reply.failed.status, reply.failed.message = int(value[0]), value[1]
    else:
        getattr(reply, OUTCOMES[type(value).DESCRIPTOR.full_name]).CopyFrom(value)
    return reply.SerializeToString()


def read_reply(frame):
    """(seq, outcome, value) of a ControlReply frame, value as reply_frame takes it. Raises one
    of MALFORMED."""
    reply = _parse(pb.ControlReply, frame)
    outcome = reply.WhichOneof("outcome")
    if outcome is None:
        raise ValueError("a control reply of no known outcome")
    value = getattr(reply, outcome)
    if outcome == "done":
        value = None
    elif outcome == "failed":
        value = (value.status, value.message)
    return reply.seq, outcome, value


def _parse(message, frame):
    frame = bytes(frame)
    if len(frame) > MAX_FRAME:
        raise ValueError(f"control frame of {len(frame)} bytes exceeds {MAX_FRAME}")
    return message.FromString(frame)


def describe(error):
    """One readable line for a frame that could not be read."""
    return str(error) or type(error).__name__
