@0x9d9dca56b3b8c9c2;
# The phos image format's messages: an image's manifest, and a handoff's delta of an image.
# One small typed message per kind of object, as CRIU's image files are. snapshot/image.py
# writes and reads them and checks what a schema cannot say (ranges, sizes, references,
# overlaps: validate_manifest, read_delta); the chunks they name are stored beside them,
# content-addressed (snapshot/image.py's docstring).
#
# In Python (snapshot/image.py) a manifest is a dict of its fields by their snake_case names
# (cutSeq: cut_seq), structs as dicts, lists as lists; a Data field as lowercase hex, but for
# the annotations below.

annotation optional(field) :Void;
# A writer may leave the field out: a number then holds its default, and any other field is
# left unset and read back absent (parent: None).

annotation pair(struct) :Text;
# The struct reads as a two-item list in Python, its fields in order; the text names them
# (for the errors that refuse another shape).

annotation keys(field) :Void;
# Data holding chunk fingerprints, 16 bytes each: in Python the list of their chunk keys
# (32 lowercase hex digits each).

const manifestFormat :Text = "phos-image";
const manifestVersion :UInt32 = 2;
# 1 was the manifest as canonical JSON; a reader refuses every version but its own.

const deltaFormat :Text = "phos-delta-3";

# An image: every object of a context, and the chunks of its memory, at a cut. The snapshot
# engine writes it (snapshot/engine.py Checkpoint.finish) and restores it (Restore).
struct Manifest {
  format @0 :Text;             # manifestFormat
  version @1 :UInt32;          # manifestVersion
  name @2 :Text;               # the image's name in its store
  parent @3 :Text $optional;   # the image it was taken after (its chunks shared), or none
  created @4 :Float64;         # unix time
  cutSeq @5 :UInt64;           # the last client call the image holds the effects of
  backend @6 :Text;            # "cuda", "emu", ...: a restore refuses another
  device @7 :Device;
  addressSpace @8 :AddressSpace $optional;
  modules @9 :List(Module);
  functions @10 :List(Function);
  globals @11 :List(Global);
  streams @12 :List(Stream);
  events @13 :List(Event);
  allocations @14 :List(Allocation);
  error @15 :Error;            # the context's sticky error (status 0: none)
  session @16 :Session $optional;   # the engine always writes it, and restores only an image that has it
  metadata @17 :Metadata;
}

struct Device {
  name @0 :Text;
  uuid @1 :Data;
  cc @2 :ComputeCapability;
  totalMem @3 :UInt64;
}
struct ComputeCapability $pair("[major, minor]") { major @0 :UInt16; minor @1 :UInt16; }

# The range of device addresses the server gives its contexts' memory.
struct AddressSpace { base @0 :UInt64; size @1 :UInt64; }

struct Module {
  id @0 :UInt64;
  name @1 :Text;
  kind @2 :Text;               # "ptx", "cubin" or "fatbin"
  image @3 :Data;              # the chunk holding its image: a 16-byte fingerprint
  size @4 :UInt64;             # of its image
}

struct Function {
  id @0 :UInt64;
  module @1 :UInt64;           # a module of the image
  name @2 :Text;
  params @3 :List(Param);
  attributes @4 :List(FunctionAttribute) $optional;   # what the application set
}
struct Param $pair("[offset, size]") { offset @0 :UInt32; size @1 :UInt32; }
struct FunctionAttribute $pair("[attribute, value]") { attribute @0 :Int32; value @1 :Int32; }   # CUfunction_attribute

# A region (an allocation or a module's global) of `size` bytes at `address` has
# ceil(size / chunkSize) chunks; chunk j holds bytes [j*chunkSize, min(size, (j+1)*chunkSize)).
struct Global {
  module @0 :UInt64;
  name @1 :Text;
  address @2 :UInt64;
  size @3 :UInt64;
  chunkSize @4 :UInt64;
  chunks @5 :Data $keys;
  device @6 :UInt64 $optional; # where the device had it, when not at `address` (0: at `address`)
}

struct Stream { id @0 :UInt64; flags @1 :UInt32; priority @2 :Int32; }
struct Event { id @0 :UInt64; flags @1 :UInt32; }

struct Allocation {
  address @0 :UInt64;
  size @1 :UInt64;
  chunkSize @2 :UInt64;
  chunks @3 :Data $keys;
}

struct Error { status @0 :Int64; message @1 :Text; }

# The context the image was taken of, which a restore takes on.
struct Session {
  ctx @0 :UInt64;
  token @1 :Data;              # the digest of its session token (snapshot/image.py token_digest): 32 bytes
  nextId @2 :UInt64;           # the next handle it gives out
  limits @3 :List(Limit) $optional;       # what the application set
  reserved @4 :List(Span) $optional;      # cuMemAddressReserve's ranges (their mappings are among allocations)
  tenant @5 :Data $optional;   # the tenant whose quota its memory counts against: a 32-byte digest
}
struct Limit $pair("[CUlimit, value]") { limit @0 :UInt64; value @1 :UInt64; }
struct Span $pair("[base, length]") { base @0 :UInt64; length @1 :UInt64; }

# How the image was taken (snapshot/engine.py Checkpoint.finish).
struct Metadata {
  mode @0 :CheckpointMode $optional;
  deviceCopy @1 :Bool $optional;          # the cut was copied on the device first
  paused @2 :Bool $optional;              # the application was stopped
  pauseMs @3 :Float64 $optional;
  recopiedChunks @4 :UInt64 $optional;
  seconds @5 :Float64 $optional;
}
enum CheckpointMode { paused @0; concurrent @1; precopy @2; }
# precopy: a handoff's pre-copy round, consistent in its objects only: never anybody's latest image

# An image as a delta of its parent: what a handoff's warm target, which holds the parent,
# needs to move on to it without reading its manifest (which may not be committed yet). The
# snapshot engine makes it (snapshot/engine.py image_delta); the control plane and the admin
# API carry it as bytes, unread, to the worker that advances by it (Restore.advance).
struct ImageDelta {
  format @0 :Text;             # deltaFormat
  name @1 :Text;               # the image
  parent @2 :Text;             # the image it moves on from (unset: none)
  cutSeq @3 :UInt64;
  objects @4 :Text;            # a digest of the image's objects (snapshot/engine.py objects_digest)
  nextId @5 :UInt64;           # the session's next handle
  error @6 :Error;             # the context's sticky error (status 0: none)
  changes @7 :List(ChunkChange);   # the chunks whose keys differ from the parent's (or every chunk)
}
struct ChunkChange {
  address @0 :UInt64;          # the region's
  index @1 :UInt64;            # the chunk's in the region
  key @2 :Data;                # its fingerprint: 16 bytes
}
