-- A journal written by the webhook before the journal recorded a schema version (one drain pending).
BEGIN TRANSACTION;
CREATE TABLE actions (
    id INTEGER PRIMARY KEY, fingerprint TEXT NOT NULL, starts_at TEXT NOT NULL, kind TEXT NOT NULL,
    node TEXT NOT NULL, gpu TEXT NOT NULL, alertname TEXT NOT NULL, summary TEXT NOT NULL,
    state TEXT NOT NULL, outcome TEXT NOT NULL DEFAULT '', reason TEXT NOT NULL DEFAULT '',
    detail TEXT NOT NULL DEFAULT '', attempts INTEGER NOT NULL DEFAULT 0, next_at REAL NOT NULL,
    progress TEXT NOT NULL DEFAULT '{}', received_at REAL NOT NULL, started_at REAL, finished_at REAL,
    updated_at REAL NOT NULL, UNIQUE (fingerprint, starts_at, kind));
INSERT INTO "actions" VALUES(1,'0000000000000001','2026-11-30T05:00:00.500000+00:00','drain','gpu01','0','GPUHealthXidFatal','XID 79: GPU has fallen off the bus','pending','','','',0,1.79617496821472930903e+09,'{}',1.79617496821472930903e+09,NULL,NULL,1.79617496821472930903e+09);
CREATE TABLE alerts (
    fingerprint TEXT NOT NULL, starts_at TEXT NOT NULL, status TEXT NOT NULL, node TEXT, gpu TEXT,
    alertname TEXT, labels TEXT NOT NULL, annotations TEXT NOT NULL, received_at REAL NOT NULL,
    resolved_at REAL, notification_id INTEGER NOT NULL, PRIMARY KEY (fingerprint, starts_at));
INSERT INTO "alerts" VALUES('0000000000000001','2026-11-30T05:00:00.500000+00:00','firing','gpu01','0','GPUHealthXidFatal','{"alertname": "GPUHealthXidFatal", "severity": "critical", "action": "drain", "node": "gpu01", "gpu": "0"}','{"summary": "XID 79: GPU has fallen off the bus", "description": "XID 79: GPU has fallen off the bus on gpu01", "runbook_url": "x"}',1.79617496821472930903e+09,NULL,1);
CREATE TABLE drained (
    node TEXT PRIMARY KEY, action_id INTEGER NOT NULL, since REAL NOT NULL, reason TEXT NOT NULL,
    keep INTEGER NOT NULL);
CREATE TABLE jobs (
    job_id TEXT PRIMARY KEY, attempts INTEGER NOT NULL, last_at REAL NOT NULL, excluded TEXT NOT NULL,
    exhausted INTEGER NOT NULL DEFAULT 0, last_node TEXT NOT NULL);
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE notifications (
    id INTEGER PRIMARY KEY, received_at REAL NOT NULL, receiver TEXT, group_key TEXT, status TEXT,
    alerts INTEGER NOT NULL, new_alerts INTEGER NOT NULL);
INSERT INTO "notifications" VALUES(1,1.79617496821472930903e+09,'gpuhealth','{}:{node="x"}','firing',1,1);
CREATE TABLE transitions (
    id INTEGER PRIMARY KEY, action_id INTEGER NOT NULL, at REAL NOT NULL, state TEXT NOT NULL,
    reason TEXT NOT NULL, detail TEXT NOT NULL);
INSERT INTO "transitions" VALUES(1,1,1.79617496821472930903e+09,'pending','','');
CREATE INDEX alerts_node ON alerts (node, status);
CREATE INDEX actions_state ON actions (state, next_at);
CREATE INDEX actions_active ON actions (id) WHERE state IN ('pending', 'running');
CREATE INDEX actions_started ON actions (started_at);
CREATE INDEX actions_node ON actions (node, state);
CREATE INDEX transitions_action ON transitions (action_id);
COMMIT;
