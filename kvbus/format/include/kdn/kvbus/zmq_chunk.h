#pragma once
// A chunk's serialized bytes as a ZeroMQ message, without a copy: the message
// holds a reference to the chunk and drops it once ZeroMQ has sent or
// discarded the frame. Shared by kdn-store's service and the tcp transport.

#include <zmq.hpp>

#include <memory>

#include "kdn/kvbus/chunk.h"

namespace kdn::kvbus {

// Throws zmq::error_t if ZeroMQ cannot set the message up (the reference is
// released then; nothing leaks).
inline zmq::message_t ChunkMessage(std::shared_ptr<const Chunk> chunk) {
  auto hold = std::make_unique<std::shared_ptr<const Chunk>>(std::move(chunk));
  const auto bytes = (*hold)->bytes();
  zmq::message_t m(
      const_cast<uint8_t*>(bytes.data()), bytes.size(),
      [](void*, void* hint) { delete static_cast<std::shared_ptr<const Chunk>*>(hint); },
      hold.get());
  hold.release();  // owned by the message from here
  return m;
}

}  // namespace kdn::kvbus
