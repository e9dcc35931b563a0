#pragma once
// kvbus transports: move KV chunks from one process's memory into another's
// ChunkStore (docs/design.md, "kvbus transports"). One small interface that
// every implementation provides; all pass tests/kvbus/transport_conformance.h.
// The control plane (offers, grants, acks) is always ZeroMQ over the
// receiver's tcp endpoint; the data plane is the transport's:
//   tcp  the chunk's bytes follow its header on the same connection;
//   shm  the receiver grants a range of its shared-memory landing segment
//        (a registered region, kdn/kvbus/region.h), the sender copies the
//        bytes there and sends only the header. Same host only.
//   cuda_ipc  a chunk claimed by a landing site whose region is a device
//        backend's memory (kdn/kvbus/device_ops.h) is written there by the
//        sender through the same backend, its header sent alone. Same host
//        (and, for CUDA, GPUs that can reach each other) only.
//   nccl  a chunk claimed by a landing site whose region is a device
//        backend's memory goes as its header, then its payload over a link
//        of that backend (DeviceLink: NCCL between GPUs) that the receiver
//        joined from the id in the sender's offers; the receiver receives
//        it onto the claimed extents. Any hosts NCCL connects.
// TransportKind::kAuto picks the region plane of each grant's region when
// the two ends share a host and the sender can open it, tcp otherwise
// (docs/kvbus.md).
//
// Landing in place: a receiver given a LandingSite asks it, for each key
// offered, where that chunk's payload goes (the decode worker: the KV
// blocks a request reserved). A claimed chunk's payload is written straight
// there, never into the sink: by the sender itself when it can map the
// site's region (shm, or cuda_ipc for a device region), else by the
// receiver from the tcp frame. Its header
// travels on the control connection, and the receiver verifies the payload
// where it lies (checksum, key, shape) before it tells the site.
//
// Asynchronous and batched: Sender::Submit hands over a batch and returns its
// id at once; Poll or Wait report, per chunk, whether it was sent, skipped
// (the receiver already held it) or failed, with a Status. Under the hood an
// offer/accept handshake: the sender offers the batch's keys and sizes, the
// receiver answers with the keys it holds (never sent) and grants slots for
// the rest under a lease, as far as its slot capacity allows; the rest is
// granted as acks free space. The receiver verifies every chunk
// (Chunk::Parse, and that the key is the one announced) before it Puts it in
// its sink. Idempotent by key: offering or sending a chunk twice is harmless.
//
// Failure: a dead receiver costs only the batches sent to it, and at once.
// The sender watches its connection: when it is lost (the receiver's process
// died or closed) the unfinished chunks of every batch fail with UNAVAILABLE
// "connection lost" straight away, and nothing more is sent for them; while
// the endpoint refuses connections (nothing listens there), a batch that has
// waited SenderOptions::connect_timeout fails with UNAVAILABLE "connection
// refused". A receiver that is alive but silent (hung, or a host that drops
// packets) fails them within SenderOptions::peer_timeout. The sender is not
// broken for good: it reconnects on its own, and a receiver that comes back
// at the endpoint serves later batches. A sender that vanishes leaks nothing
// on the receiver, whose leases expire after ReceiverOptions::lease. A
// failed batch is cancelled there (its slots freed, should the receiver only
// have been slow); chunks already stored stay (they are verified and
// content-addressed).
//
// The interface is in three headers: kdn/kvbus/transport_types.h (what both
// ends share), kdn/kvbus/sender.h and kdn/kvbus/receiver.h; this one
// includes them all.

#include "kdn/kvbus/receiver.h"
#include "kdn/kvbus/sender.h"
#include "kdn/kvbus/transport_types.h"
