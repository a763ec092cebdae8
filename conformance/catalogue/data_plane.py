"""Data-plane clauses: the transport, codec, meta and batch_ops surfaces, and the kinds of check
that hold whatever the operation (inputs intact, no aliasing, merges by value, heterogeneous
rows, every layout regime, model inputs against the processor). The catalogue's __init__ joins
them with the others."""

from __future__ import annotations

from .clause import Clause

B3 = "BACKGROUND.md s3: "

DATA_PLANE_CLAUSES: list[Clause] = [
    # -- transport ------------------------------------------------------------------------
    Clause(
        "DP-ROUNDTRIP",
        "put then get MUST return every wire column of every family exactly: values, dtype, "
        "shape and row boundaries, including None rows, media-free batches, uniform rows, "
        "several segments with differing trailing dims and de-duplicated rows.",
        "transport",
        B3 + "rollout write kept only torch.Tensor values, silently dropping jagged packed "
        "fields (prev_logprobs image-blind, token_mult_prob_error ~176)",
        ("dropped_packed_on_write", "jagged_rows_truncated", "bf16_stored_as_fp32"),
    ),
    Clause(
        "DP-LAYOUT",
        "get MUST return each column in the layout it was written: dense as dense with its "
        "shape, jagged as jagged, a 1-D column as (N,), restored only from what put recorded.",
        "transport",
        B3 + "key/value schema recorded a 1-D (N,) field as (1,) rows while storage held 0-d "
        "rows: the backend returned jagged (1,) rows instead of (N,)",
        ("scalar_rows_as_1", "uniform_jagged_densified", "dense_returned_jagged"),
    ),
    Clause(
        "DP-TAGS",
        "get MUST return tags 1:1 with the keys asked for, in the order asked, with the "
        "values put.",
        "transport",
        B3 + "per-rank fetches lost the tags needed to rebuild flattened media",
        ("tags_in_storage_order", "tags_dropped_on_get"),
    ),
    Clause(
        "DP-MISSING",
        "get of a missing partition, key or field MUST raise KeyError naming it (never a shorter "
        "or empty result), and select_fields MUST be required.",
        "transport",
        "a shorter result silently shrinks a training batch; a default field list is how the "
        "image-blind train fetch happened (BACKGROUND.md s3)",
        ("short_result_on_missing_key", "empty_column_on_missing_field", "default_select_all"),
    ),
    Clause(
        "DP-MERGE",
        "a later put of new columns under existing keys MUST add them and keep the columns "
        "and tags already stored.",
        "transport",
        "the driver writes advantages (and ranks write prev_logprobs) after the rollout write; "
        "an overwriting put drops the media",
        ("put_overwrites_row",),
    ),
    Clause(
        "DP-CLEAR-ISOLATION",
        "clear MUST remove exactly the keys (or the partition) it names, and partitions MUST be "
        "isolated from each other.",
        "transport",
        "a step's clear that removes another step's (or another partition's) keys loses data",
        ("clear_removes_partition", "partitions_shared"),
        capabilities=("partitions",),
    ),
    Clause(
        "DP-NO-ALIAS",
        "stored data MUST NOT alias caller tensors or tags: mutating a tensor or a tag (at any "
        "depth) after put, or one returned by get, MUST NOT change what a later get returns, "
        "and one get MUST NOT hand out one container or one memory twice (a key named twice "
        "gets its own tag dict, object row and tensors each time).",
        "transport",
        "an in-place op on a fetched batch (e.g. a dtype cast or mask fill) corrupts the "
        "next rank's fetch; a driver that stamps a fetched tag's shape list changes every "
        "later fetch of that row",
        ("aliasing_put", "aliasing_get", "tags_shallow_copied_on_put", "tags_shared_on_get",
         "repeated_key_rows_share_tags", "repeated_key_rows_share_tensors"),
    ),
    Clause(
        "DP-CONCURRENT",
        "one transport instance used from several threads at once MUST lose and mix nothing: "
        "concurrent puts and gets to different partitions, and to different keys of one "
        "partition, each return exactly their own values and tags, and list returns every key "
        "put.",
        "transport",
        "rollout workers and data-parallel ranks share one data-plane client; a read-modify-write "
        "of a partition's index or a shared staging buffer loses keys or hands one worker "
        "another's rows, and training goes on with the wrong samples",
        ("partition_index_lost_update", "tags_staged_on_instance", "shared_get_buffer"),
    ),
    Clause(
        "DP-BITEXACT",
        "put then get MUST return every value bit for bit: NaN with its payload and sign "
        "(quiet and signalling), +-inf, -0.0 and subnormals, in every floating dtype, dense and "
        "jagged.",
        "transport",
        "a store that flushes subnormals or round-trips through another precision changes "
        "logprobs and pixels silently; a value comparison (torch.equal) sees neither NaN nor "
        "the sign of zero",
        ("subnormals_flushed_in_store", "bf16_kept_as_fp32_in_store"),
    ),
    Clause(
        "DP-SHAPE-TAGS",
        "get MUST return each row's tags exactly as put, segment shapes included, when rows "
        "hold media of equal element count in different shapes (portrait and landscape images, "
        "one wide tile and square tiles), so every segment is rebuilt in its own shape.",
        "transport",
        B3 + "ranks rebuild flattened media from the shapes on the tags; a store that keeps "
        "sizes instead of shapes rebuilds a portrait image as landscape with no error",
        ("tag_shapes_interned_by_size",),
    ),
    # -- untrusted input: names, tags, layouts, empty calls, order, arguments, processes ----
    Clause(
        "DP-NAMES",
        "every partition, key and field name the contract allows (any str of 1 to 1024 UTF-8 "
        "bytes without NUL: separators, whitespace, glob characters, bookkeeping names, any "
        "script, the longest) MUST be stored, listed, fetched and cleared as exactly itself, "
        "and every other name MUST be refused by put, get, list and clear with a TypeError or "
        "ValueError naming the argument, changing nothing.",
        "transport",
        "rollout uids, prompt ids and user-chosen partition names reach the store unchecked; a "
        "store that trims, truncates or normalises names returns another key's row, and one "
        "that accepts the empty string or NUL loses it in a C string API",
        ("names_trimmed", "long_names_truncated", "refused_names_accepted",
         "bookkeeping_names_reserved"),
    ),
    Clause(
        "DP-NAME-ISOLATION",
        "partitions and keys whose names share prefixes or separators (p:a/b and p/a:b for "
        "every separator, p and pp, p and p*, p and P, a composed and a decomposed letter) "
        "MUST hold, list and clear only their own rows.",
        "transport",
        "a store that joins partition and key with a separator, or lists and clears a "
        "partition by a prefix scan, hands one partition's rows to another and clears them "
        "with it (found in an out-of-tree Redis transport that passed every other clause)",
        ("names_joined_with_separator", "partition_list_by_prefix",
         "partition_names_case_folded"),
        capabilities=("partitions",),
    ),
    Clause(
        "DP-TAG-VALUES",
        "every value a tag may hold (dicts with str or int keys; None, bool, int64, float "
        "including nan, +-inf and -0.0, str, list, tuple, nested) MUST come back exactly, "
        "types included, and anything else MUST be refused at put with a TypeError or "
        "ValueError, storing nothing.",
        "transport",
        "a store that serialises tags as JSON returns tuples as lists and int keys as str; one "
        "that keeps floats in float32 or accepts a value other stores cannot carry changes "
        "what a consumer rebuilds from its tags",
        ("tags_through_json", "tag_floats_as_float32", "refused_tags_accepted"),
    ),
    Clause(
        "DP-LAYOUT-CONFLICT",
        "a put of a field already stored in the partition in another layout (dense vs jagged, "
        "dtype, row shape, 1-D vs (N, 1)) MUST raise ValueError naming the field and store "
        "nothing of that put.",
        "transport",
        "a store that records the layout per key changes the layout of rows written earlier "
        "without a word; one that checks while it writes leaves half a put behind",
        ("layout_replaced_on_reput", "partial_put_on_layout_conflict"),
    ),
    Clause(
        "DP-EMPTY",
        "calls with no keys MUST have the contract's result: get returns each field as an "
        "empty column in its stored layout and no tags (KeyError for a field or partition not "
        "stored), put stores nothing, clear removes nothing, and a partition whose keys were "
        "all cleared lists [].",
        "transport",
        "an image-free or empty data-parallel shard asks for no keys; a store that crashes, "
        "returns no columns or a (0,) float column, or treats an empty key list as 'all keys' "
        "(clear(p, []) clearing the partition) breaks the step on an empty shard",
        ("get_of_no_keys_returns_nothing", "empty_get_loses_layout",
         "clear_of_no_keys_clears_partition"),
    ),
    Clause(
        "DP-ORDER",
        "get MUST return each key's own row of every column and its own tag for keys asked in "
        "any order and subset: reversed, shuffled with the ends in place, interleaved across "
        "puts.",
        "transport",
        "ranks fetch DP-balanced shards whose key order is not the put order; a store that "
        "copies a stored block when the first and last keys line up, or groups rows by the put "
        "that wrote them, hands rows to the wrong sample",
        ("contiguous_span_checked_at_ends", "rows_grouped_by_put"),
    ),
    Clause(
        "DP-ARGS-INTACT",
        "put, get, list and clear MUST leave every argument as it was: the keys list, the "
        "columns dict with every tensor's bits and every object column's rows, the tags at "
        "every depth, and select_fields.",
        "transport",
        "a caller reuses its key list, columns and tags after a put (the driver keeps the meta, "
        "the rollout its batch); a store that sorts them in place or stamps its records into "
        "the caller's tags changes the caller's batch",
        ("put_sorts_caller_keys", "get_sorts_select_fields", "put_stamps_caller_tags",
         "put_freezes_caller_object_lists"),
    ),
    Clause(
        "DP-MULTIPROCESS",
        "the store reopened by its address in another process MUST return exactly what this "
        "process put (columns, adversarial names, tags), and this process MUST read exactly "
        "what the other put.",
        "transport",
        "the rollout worker puts, the driver and the ranks get, each in its own process; a "
        "client that serialises tags or names differently between processes, or opens a fresh "
        "store, loses them between the two",
        ("peer_tags_via_json", "address_opens_fresh_store"),
        capabilities=("multiprocess",),
    ),
    Clause(
        "DP-CLEAN-SLATE",
        "clear of a partition MUST leave nothing of it (list empty, get raises KeyError, a "
        "later put of the same keys starts fresh: no stale tags, any layout), so that a run "
        "ends with the store as it found it.",
        "transport",
        "persistent stores outlive the run: five runs of the suite left 5,683 keys (52 MB) in "
        "a Redis server; a clear that drops rows but keeps tags or layouts merges stale tags "
        "into the next step's rows",
        ("clear_keeps_tags", "clear_keeps_layouts", "clear_of_path_like_partition_missed"),
    ),
    # -- the store contract as a state machine (test_store_machine.py) --------------------
    Clause(
        "DP-STORE-MODEL",
        "every sequence of put, get, list and clear MUST answer, call by call, what the "
        "contract's model answers and leave the store equal to it (every key's tags and every "
        "field's rows, bit for bit with dtype and shape, read back after each step), for names "
        "drawn in pairs a careless store confuses (case, whitespace, Unicode forms, prefixes, "
        "SQL, glob and regex metacharacters, separators, escapes, path pieces, the longest "
        "names) and values of every registry dtype (zero-size dims, 0-d rows, views): a re-put "
        "replaces the rows it names, a clear removes for good, a get returns one row per key "
        "named (twice for a key named twice) whose rows share nothing, a clear naming a key "
        "not held raises KeyError removing nothing, and a partition holding no keys lists [].",
        "transport",
        "a SQLite-backed transport written from the guide passed every clause while it kept a "
        "re-put key's old value, brought cleared values back on a later put, compared keys "
        "case-insensitively, returned fewer rows for a key named twice, dropped a zero-size "
        "dim and let `_` match any character: each lives in a sequence of calls or a pair of "
        "names no single-call clause produces",
        ("reput_keeps_old_value", "cleared_values_come_back", "repeated_key_returns_one_row",
         "repeated_key_rows_share_tags", "repeated_key_rows_share_tensors",
         "clear_removes_held_keys_before_raising",
         "list_of_unknown_partition_raises", "zero_size_dims_dropped",
         "views_read_from_storage", "key_lookup_case_insensitive",
         "key_trailing_spaces_ignored", "field_names_nfkc_normalised", "key_seek_by_prefix",
         "keys_split_into_stem_and_index",
         "underscore_is_a_wildcard", "select_fields_as_globs", "partition_clear_by_regex",
         "keys_half_escaped", "keys_as_normalised_paths", "long_keys_cut_for_the_index",
         "key_and_field_joined"),
    ),
    Clause(
        "DP-STORE-ATOMIC",
        "a call the contract refuses (a put whose later column has the wrong row count or "
        "another layout, or that holds a refused name, tag or column or a repeated key; a get, "
        "list or clear of a refused name) MUST raise TypeError or ValueError and leave the "
        "store exactly as it was, anywhere in a sequence of calls; a column in a dtype no "
        "registered field uses MUST be stored exactly or refused so.",
        "transport",
        "a store that writes column by column and checks each as it comes keeps the first "
        "columns of a put that then fails, and one that deletes key by key while it checks "
        "names clears half of a refused clear: the caller that retries reads a mix of two "
        "states",
        ("half_failed_put_keeps_first_columns", "clear_checks_names_as_it_deletes"),
    ),
    Clause(
        "DP-STORE-CLIENTS",
        "clients of one store opened by its address, and closed again, anywhere in a sequence "
        "of calls MUST each read the one store: after every step every open client's reads "
        "equal the model, whichever client wrote.",
        "transport",
        "a client that caches the key index it read answers list from its cache: a rank's "
        "client does not see the keys the driver put after it opened",
        ("client_caches_key_index", "client_close_clears_its_writes"),
        capabilities=("multiprocess",),
    ),
    # -- codec ----------------------------------------------------------------------------
    Clause(
        "WIRE-ROUNDTRIP",
        "decode(encode(batch)) MUST give back every registered field of every family as its "
        "consumers observe it: non-media fields exactly (values, dtype, shape); packed media with "
        "each row's None-ness, each row's extent on the packing dim and the model-input tensor "
        "bit for bit, also for de-duplicated rows. How a row's media are cut into segments is "
        "the codec's own business.",
        "codec",
        B3 + "decoder densified nested rows that happened to share a shape; encoder walked "
        "physical segments instead of logical rows under media de-duplication",
        ("densify_uniform_rows", "encode_physical_segments", "empty_rows_as_zero_length"),
    ),
    Clause(
        "WIRE-TRANSPORT-ROUNDTRIP",
        "decode(get(put(encode(batch)))) MUST equal the batch for every family through the "
        "backend's transport.",
        "transport",
        B3 + "jagged media lost or reshaped between the rollout write and a rank's fetch",
        ("dropped_packed_on_write", "jagged_rows_truncated", "tags_dropped_on_get"),
    ),
    Clause(
        "WIRE-JAGGED",
        "a packed field MUST travel with one wire row per sample holding exactly that sample's "
        "values (a jagged column in any row layout, or the sample's entry in a column of "
        "per-row dicts), never densified, even when every row has one segment of one shape, so "
        "that a data-parallel rank fetching some keys gets exactly those samples' media; it "
        "decodes to the same model inputs.",
        "codec",
        B3 + "decoder densified nested rows that happened to share a shape (row boundaries lost "
        "whenever every sample has one image)",
        ("densify_uniform_rows", "encode_physical_segments"),
    ),
    Clause(
        "WIRE-NONE-ROWS",
        "a row without media MUST decode as None, and a media-free batch MUST decode with every "
        "row None, never as (0, ...) tensors.",
        "codec",
        B3 + "empty media rows decoded as (0, ...) tensors: an image-free shard gave "
        "pixel_values of shape (0, ...) where legacy gave None",
        ("empty_rows_as_zero_length",),
    ),
    Clause(
        "WIRE-DTYPE",
        "with a policy dtype set, pixel fields MUST cross the wire in it (the encoded columns "
        "themselves, packed or per-row dict media) and arrive in it, integer geometry MUST never "
        "be cast, and fields a family keeps in fp32 on purpose MUST stay fp32 on the wire and "
        "after decode.",
        "codec",
        B3 + "rollout write dropped the pixel dtype cast: pixel_values crossed the wire fp32 "
        "instead of bf16, 2x the largest column",
        ("fp32_pixels", "casts_integer_geometry", "casts_kept_fp32_media",
         "fp32_on_wire_cast_after_decode"),
        capabilities=("bfloat16",),
    ),
    Clause(
        "WIRE-UNKNOWN-FIELD",
        "encoding an unregistered field MUST raise KeyError naming it; nothing is dropped "
        "silently.",
        "codec",
        B3 + "rollout write kept only known values, silently dropping the rest",
        ("unknown_field_dropped",),
    ),
    Clause(
        "WIRE-TAG-ALIGN",
        "decode MUST reject tags that do not align with the rows (a missing, extra or "
        "mismatched tag) with an error naming the field or row.",
        "codec",
        B3 + "metadata sharding dropped per-row tags; a decoder that trusts misaligned tags "
        "rebuilds the wrong images",
        ("decode_trusts_tags",),
    ),
    Clause(
        "WIRE-REGISTRY-COVERAGE",
        "every field that each family's real processor emits MUST be registered, and a batch "
        "built from real processor output MUST round-trip through the codec.",
        "codec",
        B3 + "a static text-only field list missed the media fields",
        ("empty_rows_as_zero_length",),
    ),
    Clause(
        "WIRE-BITEXACT",
        "decode(encode(batch)) MUST return every floating value bit for bit: NaN with its "
        "payload and sign (quiet and signalling), +-inf, -0.0 and subnormals, in media, "
        "per-token and per-sample fields of every floating dtype.",
        "codec",
        "an encoder that sanitises or normalises values (NaN rewritten, x * 1 + 0) changes "
        "logprobs and pixels where a value comparison (torch.equal) cannot see it",
        ("nan_canonicalised", "negative_zero_lost"),
    ),
    Clause(
        "WIRE-SHAPE-TAGS",
        "decode MUST give back media of equal size in different shapes, across rows and within "
        "a row (portrait and landscape images, transposed grids, one wide tile and square "
        "tiles), in their own shapes and geometry as the model input shows them, from what the "
        "encoder recorded and never from an element count.",
        "codec",
        B3 + "the decoder rebuilt media from what it assumed instead of what the encoder "
        "recorded; with dynamic resolution equal sizes do not mean equal shapes",
        ("image_shapes_normalised_to_landscape", "segment_shape_cache_by_size"),
    ),
    # -- meta -----------------------------------------------------------------------------
    Clause(
        "META-TAGS",
        "subset, slice, concat, drop, with_fields and stamp_tags MUST keep tags 1:1 with keys and "
        "in order, and never share tag objects between metas.",
        "meta",
        B3 + "metadata sharding for data parallelism dropped per-row tags",
        ("meta_subset_drops_tags", "meta_concat_misaligns_tags", "meta_shares_tag_dicts",
         "meta_drops_none_tag_values"),
    ),
    Clause(
        "META-DP-SHARD",
        "shard_for_dp(world) MUST give disjoint shards that cover every key, carry each key's "
        "tags and the extras, balance tokens, and an inverse permutation that restores order.",
        "meta",
        B3 + "metadata sharding for data parallelism dropped per-row tags",
        ("dp_shard_drops_tags", "dp_shard_duplicates_key", "dp_shard_bad_inverse"),
        capabilities=("dp",),
    ),
    # -- batch operations -----------------------------------------------------------------
    Clause(
        "BATCH-TRUNCATE",
        "truncation to a micro-batch sequence length MUST leave packed fields untouched and "
        "truncate every per-token field in step with input_ids, on its registered sequence "
        "dim.",
        "batch_ops",
        B3 + "truncate_tensors narrowed every >=2-D tensor on dim 1: wire-form pixel_values "
        "silently cut, or narrow(): length > size",
        ("truncate_narrows_media", "truncate_misses_per_token_map",
         "truncate_position_ids_on_dim1"),
        capabilities=("truncation",),
    ),
    Clause(
        "BATCH-PAD",
        "padding to a sequence length MUST exclude packed fields (media bytes after == before) "
        "and pad every per-token field to that length on its registered sequence dim.",
        "batch_ops",
        B3 + "materialize padded every tensor's dim 1 to the token seqlen: pixel_values "
        "inflated ~40x",
        ("pad_media_to_seqlen", "pad_position_ids_on_dim1"),
        capabilities=("padding",),
    ),
    Clause(
        "BATCH-VALIDATE",
        "the sequence-dim validator MUST accept packed fields whatever their dim 1 and reject a "
        "per-token field misaligned with input_ids, naming it.",
        "batch_ops",
        B3 + "sequence-dim validator asserted dim 1 == seqlen on every tensor: AssertionError "
        "got shape [32, 1, 3] (image_grid_thw) at step 1",
        ("validator_checks_media_seqlen", "validator_accepts_misaligned",
         "validator_checks_dim1", "validator_skips_multi_dim_per_token"),
    ),
    Clause(
        "BATCH-STAGE-FIELDS",
        "the logprob, reference-logprob and train stages MUST receive the same multimodal field "
        "set: exactly the registered multimodal fields present in the batch.",
        "batch_ops",
        B3 + "train fetch used a static text-only field list while the logprob fetch had images: "
        "probs_ratio_max 216-2661, min 0.0, mean ~0.998",
        ("train_inputs_text_only", "stage_inputs_drop_per_token_map"),
    ),
    # -- payload growth: per-row dict media, multi-dim per-token fields, batch algebra ------
    Clause(
        "WIRE-OBJECT",
        "an object column (per-row dicts of media: verl multi_modal_inputs, OpenRLHF "
        "mm_train_inputs) MUST decode exactly: None vs {} rows, each row's keys, list vs tensor "
        "values, and every tensor's dtype, shape and bits, also when no row has media.",
        "codec",
        "verl keeps a text-only row as {} and OpenRLHF as None (BACKGROUND.md s8); a wire form "
        "that normalises one into the other, fills missing keys or merges per-image lists "
        "changes what the model gets",
        ("codec_object_none_as_empty", "codec_object_missing_key_as_empty",
         "codec_object_lists_concatenated"),
    ),
    Clause(
        "WIRE-SEQ-DIM",
        "a per-token field MUST travel cut at each row's length on its registered sequence dim "
        "(position_ids [B, 3|4, S] on its last dim; the reference row is (len_i, *other dims)) "
        "and decode to the same tensor.",
        "codec",
        "M-RoPE position ids are (B, 3 or 4, S) in verl and become jagged after padding removal "
        "(BACKGROUND.md s8); code that cuts dim 1 cuts the channels",
        ("codec_cuts_per_token_dim1",),
    ),
    Clause(
        "BATCH-OBJECT-INPUTS",
        "multimodal_inputs(stage) MUST give the same model inputs (names, dtype, shape, bits) "
        "whether the media are packed fields or a per-row dict column with {} or None "
        "text-only rows.",
        "batch_ops",
        "verl builds stage inputs from non_tensor_batch['multi_modal_inputs'] "
        "(extract_multi_modal_inputs); skipping text-only rows or the dict column misaligns or "
        "drops media, the train-fetch fingerprint of BACKGROUND.md s3",
        ("object_inputs_ignored", "object_inputs_concat_rows"),
    ),
    Clause(
        "BATCH-ALGEBRA",
        "select, concat and split MUST keep every field of every row exactly (packed media "
        "as each row's share of the model input, per-row dicts with {} vs None, multi-dim "
        "per-token fields, "
        "media-free and uneven chunks, chunks of differing widths) and MUST NOT share a row's "
        "dict with the source.",
        "batch_ops",
        "frameworks' own batch algebra (verl DataProto chunk/concat/select_idxs, OpenRLHF "
        "Experience split/concat, NeMo-RL BatchedDataDict slicing): flat media re-cut by row "
        "count or renumbered on concat reach the wrong sample",
        ("concat_renumbers_media", "split_pixels_by_row_count",
         "select_shares_dict_rows", "concat_object_none_as_empty"),
        capabilities=("batch_algebra",),
    ),
    Clause(
        "BATCH-MICRO-BATCH",
        "micro_batches(batch, n, shuffle_seed) MUST give n micro-batches that hold every row "
        "exactly once with exactly its media and per-token fields, keep the order without a "
        "seed, permute whole rows by the seed (reproducibly), and concatenate back, in "
        "recorded order, to the batch.",
        "batch_ops",
        "TRL's micro-batch split/shuffle (split_tensor_dict drops rows when B % n != 0; "
        "shuffle_sequence_dict with split_pixel_values_by_grid moves media with their row) and "
        "verl's rearrange_micro_batches: a shuffle that permutes tensors but not media trains "
        "on the wrong images",
        ("micro_batch_drops_remainder", "shuffle_leaves_media_in_place",
         "micro_batch_ignores_seed"),
        capabilities=("micro_batching",),
    ),
    Clause(
        "DP-OBJECT",
        "a transport that stores object columns MUST return each row of an ObjectColumn "
        "exactly (None vs {}, keys, list values, dtype, shape, bits) for any subset and order "
        "of keys, never aliased with the caller's or a later fetch's rows.",
        "transport",
        "verl moves multi_modal_inputs as an object array of per-row dicts and OpenRLHF "
        "mm_train_inputs as a list (BACKGROUND.md s8); a store holding them by reference lets "
        "one stage's pop or in-place cast reach every later fetch",
        ("transport_object_rows_aliased", "transport_object_none_as_empty"),
        capabilities=("object_columns",),
    ),
]

# -- kinds of check that hold whatever the operation: inputs intact, no aliasing, merges by value,
# heterogeneous rows, every layout regime, model inputs against the processor ------------------
INTACT = ("a caller (the in-memory path, another rank, a retry, the next stage) keeps using "
          "what it handed over; an operation that writes into it changes that caller's data "
          "with no error")
# -- no hidden effects: the process-global state every *-NO-GLOBAL-EFFECTS clause reads ----------
GLOBAL_STATE = ("torch's, Python's and NumPy's global RNGs (CUDA's once initialised), the default "
                "dtype and device, grad, inference and anomaly mode, the deterministic-"
                "algorithm, cuDNN and TF32 flags, torch's thread counts and the environment "
                "variables")
GLOBAL_EFFECTS = ("state shared by everything in the process: an operation that seeds a global "
                  "RNG (transformers.set_seed, torch.manual_seed) makes every later shuffle, "
                  "dropout mask and sample repeat; one that leaves grad mode off makes the next "
                  "backward record nothing; a default dtype or thread count set and not restored "
                  "changes every later allocation or kernel. None of it raises or shows in the "
                  "operation's result")
UNLESS_DECLARED = (", except what the backend declares it must change there "
                   "(Backend.changes_globals, which the report lists).")
REGIME_CLAUSES: list[Clause] = [
    Clause(
        "WIRE-INPUT-INTACT",
        "encode MUST leave the batch it is given bit for bit as it was (every field, packed "
        "segment and row index, dict row, key and list value), with and without a pixel "
        "dtype, and decode MUST leave the wire batch (columns and tags) as it was.",
        "codec",
        INTACT + "; the rollout write's pixel cast written back into the caller's media leaves "
        "the in-memory path training on bf16 pixels, and a decoder that pops tag entries "
        "leaves a fetched wire batch that no second consumer can decode",
        ("encode_casts_caller_media", "decode_consumes_tags"),
    ),
    Clause(
        "META-INPUT-INTACT",
        "subset, slice, concat, drop, with_fields, stamp_tags and shard_for_dp MUST leave every "
        "meta, index list and tag dict they are given as it was, including world sizes that do "
        "not divide the rows.",
        "meta",
        INTACT + "; verl's driver balances its batch in place before dispatch, and a meta "
        "whose keys, tags or extras moved under the driver pairs rewards with the wrong rows",
        ("meta_concat_updates_first_extra", "dp_shard_stamps_caller_tags"),
    ),
    Clause(
        "BATCH-INPUT-INTACT",
        "truncate, pad_to, validate, multimodal_inputs (every stage, with and without a dtype), "
        "select, split, concat and micro_batches (batch sizes that the micro-batch count does "
        "not divide, with and without a shuffle seed) MUST leave every argument they are given "
        "(each batch, index or size list, list of batches) bit for bit as it was.",
        "batch_ops",
        INTACT + "; a cast, a shuffle or a note written into the caller's batch (frameworks' "
        "in-place DataProto, meta_info and tensor-dict updates) changes it for every later "
        "stage and misaligns it with everything computed before",
        ("stage_inputs_cast_caller_media", "micro_batches_annotate_caller",
         "concat_consumes_caller_list"),
    ),
    Clause(
        "DP-NO-GLOBAL-EFFECTS",
        "put (tensor and, where stored, object columns), get (a key named twice, a key not "
        "stored), list and clear (keys, a partition) MUST leave " + GLOBAL_STATE + " as they "
        "were" + UNLESS_DECLARED,
        "transport",
        GLOBAL_EFFECTS + "; store clients configure their worker processes through the "
        "environment",
        ("store_client_exports_env",),
    ),
    Clause(
        "WIRE-NO-GLOBAL-EFFECTS",
        "encode (with and without a pixel dtype) and decode, of packed media and of per-row "
        "dict media, MUST leave " + GLOBAL_STATE + " as they were" + UNLESS_DECLARED,
        "codec",
        GLOBAL_EFFECTS + "; a cast done by setting torch's default dtype reaches every tensor "
        "the process builds afterwards, and an id drawn from a global RNG moves the caller's "
        "own sampling",
        ("codec_draws_numpy_rng",),
    ),
    Clause(
        "META-NO-GLOBAL-EFFECTS",
        "construction, subset, slice, concat, drop, with_fields, stamp_tags and shard_for_dp "
        "MUST leave " + GLOBAL_STATE + " as they were" + UNLESS_DECLARED,
        "meta",
        GLOBAL_EFFECTS + "; a DP balancer that breaks ties with a seeded global RNG re-seeds "
        "the driver's own sampling",
        ("dp_shard_seeds_python_random",),
    ),
    Clause(
        "BATCH-NO-GLOBAL-EFFECTS",
        "validate, multimodal_inputs (every stage, with and without a dtype), truncate, "
        "pad_to, select, split, concat, micro_batches (with and without a shuffle seed) and "
        "union MUST leave " + GLOBAL_STATE + " as they were" + UNLESS_DECLARED,
        "batch_ops",
        GLOBAL_EFFECTS + "; a shuffle seeded through torch.manual_seed instead of a generator "
        "of its own resets the RNG the trainer's dropout and the engine's sampling draw from",
        ("micro_batches_seed_torch_rng",),
    ),
    Clause(
        "WIRE-REGIMES",
        "decode MUST rebuild the batch exactly for every family in every "
        "layout regime (rows of truly one length, one row, one token per row, zero-length rows; "
        "media in some rows and in none), with M-RoPE position_ids [B, C, S] in each, after the "
        "wire batch was serialised (torch.save / torch.load) and handed to a fresh codec.",
        "codec",
        "a wire batch crosses to other processes (ranks, a store's server) and is decoded by "
        "another codec instance: anything the decoder takes from the encoder's own state "
        "instead of the wire is lost there, and regimes that random lengths reach only by "
        "coincidence (one length for all rows, zero-length rows) take other code paths",
        ("codec_state_not_on_wire",),
    ),
    Clause(
        "BATCH-REGIMES",
        "in every layout regime (rows of truly one length, one row, one token per row, "
        "zero-length rows; media in some rows and in none; M-RoPE position_ids [B, C, S] in "
        "each), every conversion the backend offers MUST keep every row exactly through "
        "serialisation: pad_to then truncate back, split then concat, micro_batches (a count "
        "that does not divide the rows, with and without a shuffle seed) holding every row once.",
        "batch_ops",
        "frameworks ship chunks and micro-batches between processes (Ray, torch.distributed); a "
        "dynamic batcher that packs rows by token count drops rows without tokens, and a form "
        "that only survives in its own process breaks there",
        ("micro_batch_drops_empty_rows",),
    ),
    Clause(
        "WIRE-HETERO-ROWS",
        "decode(encode(batch)) MUST give back every row exactly when rows differ: per-row dict "
        "columns with None and {} rows side by side, keys first appearing in a later row "
        "(video-only before image rows), per-image list values beside tensor values of the same "
        "key, keys in another order; packed media with as many images as rows but not one per "
        "row, and one row holding every image.",
        "codec",
        "a wire schema inferred from the first row drops the keys a later row brings, and an "
        "assignment inferred from a count gives rows each other's images; uniform rows pass "
        "both",
        ("codec_object_keys_of_first_dict_row", "codec_media_assigned_by_count"),
    ),
    Clause(
        "BATCH-HETERO-ROWS",
        "from rows that differ (as in WIRE-HETERO-ROWS) select, split, concat and "
        "micro_batches (counts equal to the image count and to the row count) MUST keep every "
        "key and every row's media with its row, and stage inputs MUST be those of the same "
        "media held uniformly (every key of any row, each row's media in row order), or the "
        "operation raises.",
        "batch_ops",
        "frameworks rebuild per-row media through columnar forms whose keys come from the first "
        "row (verl list_of_dict_to_dict_of_list) and split flat media by counts (a processor "
        "gives one image per text when the counts match): right on uniform rows, silently "
        "wrong on these",
        ("select_keys_of_first_row", "micro_batch_media_by_count"),
    ),
    Clause(
        "BATCH-MODEL-INPUTS",
        "for rows whose batch a family's real processor built (unequal image counts, a "
        "text-only row; one row holding every image; every row two images of unequal sizes; "
        "every pair of family, media form and pattern), the model inputs multimodal_inputs gives "
        "for each stage, also after "
        "truncate, pad_to, select, split and micro_batches (with and without a shuffle), MUST "
        "equal what the processor produces for exactly those rows (names, dtype, shape, bits; "
        "per-token maps over each row's tokens), and each row's media MUST be that sample's "
        "own processor output.",
        "batch_ops",
        "the stage-input clauses compare a backend with itself (packed against dict media, "
        "before against after truncation): a stage that normalises pixels twice or hands a "
        "row's images over in another order passes them all, and the model trains on other "
        "pixels than the rollout saw",
        ("stage_inputs_normalised_twice", "stage_inputs_images_reversed_in_row",
         "stage_inputs_image_major_on_equal_counts"),
    ),
    Clause(
        "META-NO-ALIAS",
        "no result of subset, slice, concat, drop, with_fields, stamp_tags or shard_for_dp MAY "
        "share a container with a meta it came from, nor hold one container in two places "
        "(two rows' tags, two shards' lists): mutating any tag dict (at any depth), key or "
        "length list or extra of a result leaves every source meta as it was.",
        "meta",
        B3 + "metadata sharding for data parallelism dropped per-row tags; a rank that stamps "
        "or rewrites its shard's tags through shared dicts rewrites the driver's meta and the "
        "other ranks' shards",
        ("meta_concat_shares_tags", "dp_shard_copies_tags_shallowly", "dp_shards_share_fields"),
    ),
    Clause(
        "BATCH-NO-ALIAS",
        "no result of select, split, concat or micro_batches MAY share a container with a batch "
        "it came from, also where the result holds every row in order, nor hold one container in "
        "two places (two chunks' extras, a dict row handed out twice for a repeated index): "
        "mutating a result's field dict, packed row and segment lists, dict rows or their "
        "per-image lists leaves every source batch as it was (tensors may be shared).",
        "batch_ops",
        "verl pops keys from a micro-batch's multi_modal_inputs rows and frameworks append to "
        "per-image lists; through a shallow row copy or a select that returns its input when "
        "nothing moves, that reaches the source batch and every other chunk of it",
        ("select_shares_list_values", "select_of_every_row_returns_source",
         "split_chunks_share_extra"),
        capabilities=("batch_algebra",),
    ),
    Clause(
        "META-MERGE-BY-VALUE",
        "concat MUST decide by value: metas over disjoint rows whose partition, fields, tags and "
        "extras are equal but not the same objects (one sent through serialisation, as a "
        "rank's meta comes back) join exactly as identical ones do, and metas over overlapping "
        "keys or of another partition are refused whether or not their objects are shared.",
        "meta",
        "DP collect joins metas that crossed a process boundary: nothing in them is the driver's "
        "own object any more, and a check by identity refuses them (or, the other way, lets a "
        "duplicated key through)",
        ("meta_concat_compares_by_identity",),
    ),
    Clause(
        "BATCH-MERGE-BY-VALUE",
        "concat MUST decide by value: two views of the same rows whose media objects are equal "
        "but not the same (one sent through serialisation) concatenate exactly as identical "
        "views do, and batches of another family are refused whether or not objects are shared.",
        "batch_ops",
        "chunks computed in other processes come back as equal copies, never as the driver's "
        "objects; a merge that compares by identity refuses them",
        ("concat_checks_family_by_identity",),
        capabilities=("batch_algebra",),
    ),
    Clause(
        "BATCH-UNION",
        "union(a, b) of two views of the same rows MUST decide by value: overlapping fields "
        "equal bit for bit (NaN payloads included) but held in other objects (dict rows, "
        "packed media, tensors) are accepted and every field of both is kept exactly; an "
        "overlapping field that differs, or another row count, is refused naming it; neither "
        "input is modified.",
        "batch_ops",
        "verl's DataProto.union compares overlapping per-row media dicts with == "
        "(union_numpy_dict -> _deep_equal), which holds for the same dict object and raises "
        "'Boolean value of Tensor with more than one value is ambiguous' for an equal copy, "
        "compares tensors with torch.equal (a NaN never equal), and writes the union into "
        "its own self",
        ("union_compares_by_identity",),
        capabilities=("batch_union",),
    ),
]
