// The compressor bookkeeping of one step (GroupMeta, one ratio); built and called by
// deepinfer/cache/native_group_meta.py.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// Every field of one ratio's bookkeeping, padded, kept between the two calls.
struct GroupMetaScratch {
  std::vector<int64_t> buffer_rows, overlap_rows;  // sorted, unique, then padded
  std::vector<int64_t> group_rows, prev_rows, group_pos, entry_slot;
  std::vector<int64_t> buf_src, buf_dst, ovl_src, ovl_dst, snap_src, snap_dst;
  std::vector<int64_t> restore_src, restore_dst, entry_idx;
  std::vector<uint8_t> entry_valid;
};

thread_local GroupMetaScratch scratch;

// Coded source row (group_meta._source_rows) of lane `lane` of group `g` of a chunk.
inline int64_t source_row(int64_t g, int64_t lane, int64_t r, int64_t start, int64_t base, int64_t slot) {
  const int64_t q = g * r + lane;
  if (q >= start) return base + q - start;
  const int64_t pool_row = slot * r + lane;
  return q >= (start / r) * r ? -2 * pool_row - 1 : -2 * pool_row - 2;
}

thread_local int64_t min_rows = 2;  // step_chunks.MIN_ROWS, set by each build

// `want` rows: `n` real ones and fill up to the padded length (fixed: exactly `fixed`,
// else at least `min_rows` when padded). Returns false when the real rows do not fit.
inline bool padded_len(int64_t n, int64_t padded, int64_t fixed, int64_t* want) {
  if (!padded) { *want = n; return true; }
  if (fixed >= 0) { *want = fixed; return n <= fixed; }
  *want = std::max<int64_t>(n, min_rows);
  return true;
}

inline bool pad(std::vector<int64_t>& v, int64_t units, int64_t width, int64_t fill, int64_t padded,
                int64_t fixed) {
  int64_t want;
  if (!padded_len(units, padded, fixed, &want)) return false;
  v.resize(want * width, fill);
  return true;
}

// Position of each value of `sorted` (unique, >= 0) in it, looked up directly: a binary
// search per row was most of a step's build when a large group closes.
// Only the entries of this call's values are written, and only those are read.
struct RowIndex {
  std::vector<int64_t> at;
  void fill(const std::vector<int64_t>& sorted) {
    if (!sorted.empty() && at.size() <= static_cast<size_t>(sorted.back())) at.resize(sorted.back() + 1);
    for (size_t i = 0; i < sorted.size(); ++i) at[sorted[i]] = static_cast<int64_t>(i);
  }
  int64_t operator()(int64_t value) const { return at[value]; }
};
thread_local RowIndex buffer_index, overlap_index;

}  // namespace

// Returns 0, or -1 when a padded size is smaller than the step needs or a block table does
// not reach a position it must (the caller then runs the NumPy builder). sizes[8]: padded
// groups, buffer rows read, overlap rows read, open-group tokens, overlap copies,
// snapshots, restores, entries per token.
extern "C" int64_t group_meta_build(
    const int64_t* chunk_start, const int64_t* chunk_end, const int64_t* chunk_slot,
    const int64_t* chunk_base, const uint8_t* chunk_restore, const int64_t* tables, int64_t num_chunks,
    int64_t max_blocks, const int64_t* positions, const int64_t* seq_of_token, int64_t num_tokens,
    int64_t block_size, int64_t r, int64_t padded, int64_t max_model_len, int64_t null_slot,
    int64_t null_block, int64_t min_rows_, int64_t* sizes) {
  GroupMetaScratch& s = scratch;
  min_rows = min_rows_;
  const int64_t epb = block_size / r, T = num_tokens;
  const bool fixed = padded && max_model_len >= 0;
  const int64_t per_group = fixed ? T : -1, per_row = fixed ? T * r : -1;
  s.group_rows.clear(); s.prev_rows.clear(); s.group_pos.clear(); s.entry_slot.clear();
  s.ovl_src.clear(); s.ovl_dst.clear(); s.snap_src.clear(); s.snap_dst.clear();
  s.restore_src.clear(); s.restore_dst.clear(); s.buf_src.clear(); s.buf_dst.clear();
  std::vector<uint8_t> has_previous;
  std::vector<int64_t> read_buffer, read_overlap;

  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t start = chunk_start[c], end = chunk_end[c], slot = chunk_slot[c];
    const int64_t base = chunk_base[c];
    const int64_t* table = tables + c * max_blocks;
    const int64_t lo = start / r, hi = end / r;
    for (int64_t g = lo; g < hi; ++g) {
      const size_t first = s.group_rows.size();
      for (int64_t l = 0; l < r; ++l) s.group_rows.push_back(source_row(g, l, r, start, base, slot));
      for (int64_t l = 0; l < r; ++l)
        s.prev_rows.push_back(g > 0 ? source_row(g - 1, l, r, start, base, slot) : -1);
      has_previous.push_back(g > 0);
      s.group_pos.push_back(g * r);
      if (g / epb >= max_blocks) return -1;  // a table too short for the chunk: NumPy raises
      s.entry_slot.push_back(table[g / epb] * epb + g % epb);
      if ((g + 1) * r % block_size == 0) {  // ends a block: its snapshot
        const int64_t block = table[((g + 1) * r - 1) / block_size];
        for (int64_t l = 0; l < r; ++l) {
          s.snap_src.push_back(s.group_rows[first + l]);
          s.snap_dst.push_back(block * r + l);
        }
      }
    }
    if (hi > lo) {  // the chunk's newest group becomes its overlap rows
      const size_t newest = s.group_rows.size() - r;
      for (int64_t l = 0; l < r; ++l) {
        s.ovl_src.push_back(s.group_rows[newest + l]);
        s.ovl_dst.push_back(slot * r + l);
      }
    }
  }
  for (int64_t c = 0; c < num_chunks; ++c) {  // prefix hits restore the block before their start
    if (!chunk_restore[c] || chunk_start[c] <= 0) continue;
    const int64_t col = chunk_start[c] / block_size - 1;
    if (col < 0 || col >= max_blocks) return -1;  // never block-aligned here: NumPy's rules
    const int64_t block = tables[c * max_blocks + col];
    for (int64_t l = 0; l < r; ++l) {
      s.restore_src.push_back(block * r + l);
      s.restore_dst.push_back(chunk_slot[c] * r + l);
    }
  }
  const int64_t groups = static_cast<int64_t>(has_previous.size());

  // Pool rows read (members and existing previous groups; the copies are among the members).
  for (int64_t i = 0; i < groups * r; ++i) {
    const int64_t rows[2] = {s.group_rows[i], has_previous[i / r] ? s.prev_rows[i] : 0};
    for (int64_t row : rows) {
      if (row >= 0) continue;
      if (row % 2 != 0) read_buffer.push_back((-row - 1) / 2);
      else read_overlap.push_back((-row - 2) / 2);
    }
  }
  for (auto* v : {&read_buffer, &read_overlap}) {
    std::sort(v->begin(), v->end());
    v->erase(std::unique(v->begin(), v->end()), v->end());
  }
  s.buffer_rows = read_buffer;
  s.overlap_rows = read_overlap;
  if (padded) {
    const int64_t null_slot_row = null_slot * r, null_block_row = null_block * r;
    const int64_t copies = static_cast<int64_t>(s.ovl_src.size()), snaps = static_cast<int64_t>(s.snap_src.size());
    const int64_t restores = static_cast<int64_t>(s.restore_src.size());
    bool ok = pad(s.group_rows, groups, r, 0, padded, per_group) && pad(s.prev_rows, groups, r, -1, padded, per_group)
              && pad(s.group_pos, groups, 1, 0, padded, per_group)
              && pad(s.entry_slot, groups, 1, null_block * epb, padded, per_group)
              && pad(s.ovl_src, copies, 1, 0, padded, per_row) && pad(s.ovl_dst, copies, 1, null_slot_row, padded, per_row)
              && pad(s.snap_src, snaps, 1, 0, padded, per_row) && pad(s.snap_dst, snaps, 1, null_block_row, padded, per_row)
              && pad(s.restore_src, restores, 1, null_block_row, padded, per_row)
              && pad(s.restore_dst, restores, 1, null_slot_row, padded, per_row)
              && pad(s.buffer_rows, static_cast<int64_t>(read_buffer.size()), 1, null_slot_row, padded, per_row)
              && pad(s.overlap_rows, static_cast<int64_t>(read_overlap.size()), 1, null_slot_row, padded, per_row);
    if (!ok) return -1;
  }
  const int64_t t_total = T, num_buffer = static_cast<int64_t>(s.buffer_rows.size());
  buffer_index.fill(read_buffer);
  overlap_index.fill(read_overlap);
  auto numbered = [&](int64_t row) -> int64_t {
    if (row >= 0) return row;
    if (row % 2 != 0) return t_total + buffer_index((-row - 1) / 2);
    return t_total + num_buffer + overlap_index((-row - 2) / 2);
  };
  for (auto& row : s.group_rows) row = numbered(row);
  for (size_t i = 0; i < s.prev_rows.size(); ++i) {
    const size_t g = i / r;
    s.prev_rows[i] = g < has_previous.size() && has_previous[g] ? numbered(s.prev_rows[i]) : -1;
  }
  for (auto& row : s.ovl_src) row = numbered(row);
  for (auto& row : s.snap_src) row = numbered(row);

  // Tokens past their chunk's last group boundary start or extend its open group.
  int64_t num_entries = 0;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t c = seq_of_token[t], pos = positions[t];
    if (pos >= (chunk_end[c] / r) * r) {
      s.buf_src.push_back(t);
      s.buf_dst.push_back(chunk_slot[c] * r + pos % r);
    }
    num_entries = std::max(num_entries, (pos + 1) / r);
  }
  if (padded) {
    const int64_t open = static_cast<int64_t>(s.buf_src.size());
    if (!pad(s.buf_src, open, 1, 0, padded, per_group) || !pad(s.buf_dst, open, 1, null_slot * r, padded, per_group))
      return -1;
    num_entries = fixed ? max_model_len / r : std::max<int64_t>(num_entries, min_rows);
  }
  s.entry_idx.resize(T * num_entries);
  s.entry_valid.resize(T * num_entries);
  for (int64_t t = 0; t < T; ++t) {  // entry j: block column j / epb (clamped), lane j % epb
    const int64_t* table = tables + seq_of_token[t] * max_blocks;
    const int64_t visible = (positions[t] + 1) / r;
    int64_t* idx = s.entry_idx.data() + t * num_entries;
    uint8_t* valid = s.entry_valid.data() + t * num_entries;
    for (int64_t j0 = 0, col = 0; j0 < num_entries; j0 += epb, ++col) {
      const int64_t first = table[std::min(col, max_blocks - 1)] * epb;
      for (int64_t j = j0; j < std::min(j0 + epb, num_entries); ++j) {
        valid[j] = j < visible;
        idx[j] = padded && j >= visible ? null_block * epb : first + (j - j0);
      }
    }
  }
  sizes[0] = static_cast<int64_t>(s.group_pos.size());
  sizes[1] = num_buffer;
  sizes[2] = static_cast<int64_t>(s.overlap_rows.size());
  sizes[3] = static_cast<int64_t>(s.buf_src.size());
  sizes[4] = static_cast<int64_t>(s.ovl_src.size());
  sizes[5] = static_cast<int64_t>(s.snap_src.size());
  sizes[6] = static_cast<int64_t>(s.restore_src.size());
  sizes[7] = num_entries;
  return 0;
}

// Copies the last build's fields into the caller's tensors (GroupMeta's field order).
extern "C" void group_meta_copy(int64_t** outs, uint8_t* entry_valid) {
  const GroupMetaScratch& s = scratch;
  const std::vector<int64_t>* fields[] = {
      &s.buffer_rows, &s.overlap_rows, &s.group_rows, &s.prev_rows, &s.group_pos, &s.entry_slot,
      &s.buf_src, &s.buf_dst, &s.ovl_src, &s.ovl_dst, &s.snap_src, &s.snap_dst,
      &s.restore_src, &s.restore_dst, &s.entry_idx};
  for (size_t i = 0; i < sizeof(fields) / sizeof(fields[0]); ++i)
    if (!fields[i]->empty()) std::memcpy(outs[i], fields[i]->data(), fields[i]->size() * sizeof(int64_t));
  if (!s.entry_valid.empty()) std::memcpy(entry_valid, s.entry_valid.data(), s.entry_valid.size());
}
