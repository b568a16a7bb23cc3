-- Issue 12: parts under 256 MiB are written Compact (one data file per part) instead of Wide (two
-- files per column, and per Array/Nullable stream: ~250 files for a verification_results part).
-- A rebuild's 40,000-event inserts made Wide parts and spent about 6 us of kernel time per event
-- creating their files; Compact parts cut that by three quarters. Merged parts past the
-- threshold are still Wide, so large tables keep reading one column at a time. ALTER, so an
-- existing deployment's tables change on the next start; parts already written stay as they are.
ALTER TABLE {db}.events MODIFY SETTING min_bytes_for_wide_part = 268435456;
ALTER TABLE {db}.verification_results MODIFY SETTING min_bytes_for_wide_part = 268435456;
