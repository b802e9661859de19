CREATE EXTENSION IF NOT EXISTS pgstattuple;
SELECT c.relname, k.part, round(pg_relation_size(k.oid)/1048576.0,2) AS mib,
       round(s.tuple_len/1048576.0,2) AS live, round(s.dead_tuple_len/1048576.0,2) AS dead, round(s.free_space/1048576.0,2) AS free
FROM pg_class c
CROSS JOIN LATERAL (VALUES ('heap', c.oid), ('toast', c.reltoastrelid)) k(part, oid)
CROSS JOIN LATERAL pgstattuple(k.oid::regclass) s
WHERE c.relkind = 'r' AND c.relnamespace = current_schema()::regnamespace AND k.oid <> 0 AND pg_relation_size(k.oid) > 0
UNION ALL
SELECT t.relname, 'index:' || i.relname, round(pg_relation_size(i.oid)/1048576.0,2), NULL, NULL, NULL
FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid JOIN pg_class t ON t.oid = x.indrelid
WHERE t.relnamespace = current_schema()::regnamespace AND pg_relation_size(i.oid) > 0
ORDER BY 1, 2;
SELECT round(sum(pg_total_relation_size(c.oid))/1048576.0,2) AS total_mib FROM pg_class c WHERE c.relkind='r' AND c.relnamespace = current_schema()::regnamespace;
SELECT round(pg_database_size(current_database())/1048576.0,2) AS db_mib;
