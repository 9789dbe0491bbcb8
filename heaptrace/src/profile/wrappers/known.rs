//! Allocator wrappers known by name. Two kinds:
//!
//! - [`BASE`]: the bottom of a layered family (`operator new`, `__rust_alloc`). The list does
//!   not hold the family whole (`std::allocator::allocate`, `RawVec::grow` sit above), so
//!   detection still looks at their callers.
//! - [`SERVICES`]: a well-known service's or library's allocation layer, whole (every entry
//!   point, checked against its source and, where named, its stacks here). A function calling
//!   one of these calls a wrapper: it names a site, detection never takes it for another
//!   wrapper (`dictCreate` calling `zmalloc`, `ngx_event_accept` calling `ngx_create_pool`).

/// Wrappers every program shares, by the start of their names.
pub const BASE: [&str; 7] = [
    "operator new",
    "__rust_alloc",
    "__rust_realloc",
    "__rdl_alloc",
    "__rdl_realloc",
    "__rg_alloc",
    "alloc::alloc::",
];

/// Services' allocation layers, by exact function name, with whose they are.
pub const SERVICES: [(&str, &[&str]); 6] = [
    (
        "Redis",
        &[
            "zmalloc",
            "zcalloc",
            "zrealloc",
            "ztrymalloc",
            "ztrycalloc",
            "ztryrealloc",
            "zmalloc_usable",
            "zcalloc_usable",
            "zrealloc_usable",
            "ztrymalloc_usable",
            "ztrycalloc_usable",
            "ztryrealloc_usable",
            "ztrymalloc_usable_internal",
            "ztrycalloc_usable_internal",
            "ztryrealloc_usable_internal",
            "zcalloc_num",
            "zmalloc_no_tcache",
            "zstrdup",
        ],
    ),
    (
        "nginx",
        &[
            "ngx_alloc",
            "ngx_calloc",
            "ngx_memalign",
            "ngx_create_pool",
            "ngx_palloc",
            "ngx_pnalloc",
            "ngx_pcalloc",
            "ngx_pmemalign",
            "ngx_palloc_small",
            "ngx_palloc_block",
            "ngx_palloc_large",
        ],
    ),
    (
        "PostgreSQL",
        &[
            "palloc",
            "palloc0",
            "palloc_extended",
            "palloc_aligned",
            "palloc_mul",
            "palloc0_mul",
            "palloc_mul_extended",
            "repalloc",
            "repalloc0",
            "repalloc_extended",
            "repalloc_huge",
            "repalloc_mul",
            "repalloc_mul_extended",
            "pstrdup",
            "pnstrdup",
            "MemoryContextAlloc",
            "MemoryContextAllocZero",
            "MemoryContextAllocZeroAligned",
            "MemoryContextAllocExtended",
            "MemoryContextAllocHuge",
            "MemoryContextAllocAligned",
            "MemoryContextStrdup",
            "AllocSetAlloc",
            "AllocSetAllocLarge",
            "AllocSetAllocFromNewBlock",
            "AllocSetRealloc",
            "AllocSetContextCreateInternal",
            "GenerationAlloc",
            "GenerationRealloc",
            "GenerationContextCreate",
            "SlabAlloc",
            "SlabContextCreate",
            "BumpAlloc",
            "BumpContextCreate",
        ],
    ),
    (
        "CPython",
        &[
            "PyMem_Malloc",
            "PyMem_Calloc",
            "PyMem_Realloc",
            "PyMem_RawMalloc",
            "PyMem_RawCalloc",
            "PyMem_RawRealloc",
            "PyObject_Malloc",
            "PyObject_Calloc",
            "PyObject_Realloc",
            "_PyMem_RawMalloc",
            "_PyMem_RawCalloc",
            "_PyMem_RawRealloc",
            "_PyMem_RawStrdup",
            "_PyMem_RawWcsdup",
            "_PyMem_Strdup",
            "_PyObject_Malloc",
            "_PyObject_Calloc",
            "_PyObject_Realloc",
            "pymalloc_alloc",
            "pymalloc_realloc",
            "allocate_from_new_pool",
            "new_arena",
            "_PyObject_ArenaMmap",
            "_PyMem_ArenaAlloc",
            // The first frames of a pymalloc arena's stack, taken at its mmap.
            "mmap",
            "mmap64",
            "__mmap",
            "__mmap64",
            "__GI___mmap64",
            "arena_map_get",
            "arena_map_mark_used",
            "_PyMem_DebugRawAlloc",
            "_PyMem_DebugRawMalloc",
            "_PyMem_DebugRawCalloc",
            "_PyMem_DebugRawRealloc",
            "_PyMem_DebugMalloc",
            "_PyMem_DebugCalloc",
            "_PyMem_DebugRealloc",
        ],
    ),
    (
        "GLib",
        &[
            "g_malloc",
            "g_malloc0",
            "g_realloc",
            "g_try_malloc",
            "g_try_malloc0",
            "g_try_realloc",
            "g_malloc_n",
            "g_malloc0_n",
            "g_realloc_n",
            "g_try_malloc_n",
            "g_try_malloc0_n",
            "g_try_realloc_n",
            "g_aligned_alloc",
            "g_aligned_alloc0",
            "g_slice_alloc",
            "g_slice_alloc0",
            "g_memdup",
            "g_memdup2",
            "g_strdup",
            "g_strndup",
        ],
    ),
    (
        "SQLite",
        &[
            "sqlite3_malloc",
            "sqlite3_malloc64",
            "sqlite3_realloc",
            "sqlite3_realloc64",
            "sqlite3Malloc",
            "sqlite3MallocZero",
            "sqlite3Realloc",
            "sqlite3DbMallocRaw",
            "sqlite3DbMallocRawNN",
            "sqlite3DbMallocZero",
            "sqlite3DbRealloc",
            "sqlite3DbReallocOrFree",
            "sqlite3MemMalloc",
            "sqlite3MemRealloc",
            "dbMallocRawFinish",
            "dbReallocFinish",
            "mallocWithAlarm",
        ],
    ),
];

/// Frames between the allocator and a service's wrapper, in the wrapper's own file, taken as
/// the wrapper's own: PostgreSQL's `palloc` calls `AllocSetAlloc` through a pointer, and
/// without a symbol table that frame reads `postgres+0x5c785f`.
pub const INSIDE: usize = 2;

/// Whether `function` is the bottom of a layered family.
pub fn is_base(function: &str) -> bool {
    BASE.iter().any(|w| function.starts_with(w))
}

/// Whether `function` is one of a service's wrappers. A compiler's clone of one
/// (`AllocSetAlloc.part.0`, `ngx_palloc_small.isra.0`) is one too.
pub fn is_service(function: &str) -> bool {
    let name = function.split_once('.').map_or(function, |(n, _)| n);
    SERVICES.iter().any(|(_, names)| names.contains(&name))
}
