// A KV cache buffer's update as one MLX primitive: mx.slice_update of (B, H, L, D) rows
// at a position read when the step runs costs MLX three tasks (a copy or a move of the
// buffer, the offset computed by a task of its own, the copy of the rows) and their
// dispatching; this is one, and like MLX's it takes over the buffer when nothing else
// holds it (a primitive of one output can: its input is held by that output alone).
#include <cstring>
#include <stdexcept>
#include <string>

#include "mlx/backend/cpu/encoder.h"
#include "primitive.h"
#include "primitive_util.h"

namespace lt {

mx::array kv_write(const mx::array& buf, const mx::array& upd, const mx::array& pos,
                   mx::StreamOrDevice s) {
  check_4d(buf, "buf");
  check_4d(upd, "upd");
  if (upd.dtype() != buf.dtype() || upd.shape(0) != buf.shape(0) || upd.shape(1) != buf.shape(1) ||
      upd.shape(3) != buf.shape(3) || upd.shape(2) > buf.shape(2))
    throw std::invalid_argument("llama_tp kernels: kv_write's rows do not fit the buffer");
  if (pos.size() != 1)
    throw std::invalid_argument("llama_tp kernels: kv_write takes one position, got " +
                                std::to_string(pos.size()));
  return mx::array(buf.shape(), buf.dtype(), std::make_shared<KVWrite>(mx::to_stream(s)),
                   {buf, upd, mx::astype(pos, mx::int32, s)});
}

void KVWrite::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array &buf = inputs[0], &upd = inputs[1], &pos = inputs[2];
  mx::array& out = outputs[0];
  // as MLX's copy: the buffer taken over when this op holds the last reference to it
  bool take = buf.is_donatable() && buf.flags().row_contiguous &&
              buf.buffer_size() <= out.nbytes() + 16384;
  if (take) {
    out.copy_shared_buffer(buf);
  } else {
    out.set_data(mx::allocator::malloc(out.nbytes()));
  }
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) enc.set_input_array(a);
  enc.set_output_array(out);
  enc.dispatch([b = View(buf), u = View(upd), p = pos.data<int32_t>(), o = out.data<uint8_t>(),
                take, B = buf.shape(0), H = buf.shape(1), S = buf.shape(2), L = upd.shape(2),
                D = buf.shape(3)]() {
    size_t item = b.item, row = (size_t)D * item;
    if (!take) {  // the buffer's values first (row-major), then the new rows over them
      std::vector<uint8_t> keep;
      std::memcpy(o, b.bytes(keep), b.size * item);
    }
    // a position past the buffer's end is clamped (never a write outside it)
    int64_t at = *p < 0 ? 0 : (*p > S - L ? S - L : *p);
    std::vector<uint8_t> keep;
    const uint8_t* src = u.bytes(keep);  // (B, H, L, D) row-major
    for (int64_t i = 0; i < B * H; i++)
      std::memcpy(o + ((size_t)i * S + at) * row, src + (size_t)i * L * row, (size_t)L * row);
  });
}

void KVWrite::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("llama_tp kernels run on the CPU stream only");
}

}  // namespace lt
