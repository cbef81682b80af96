#!/usr/bin/env python3
# libvirt-executor's garm bootstrap, run once by cloud-init as root on the
# first boot: it does what garm's own providers' user-data does (report
# progress to garm with the instance token, download the runner tool and
# verify its sha256, register the runner with JIT credentials or a
# registration token, start it as a service, report system info and idle,
# or failed). Its only argument is the JSON file the provider wrote into
# the seed (0600 root); the token is read from it, never from the command
# line, and the file is removed when the bootstrap ends.
import hashlib
import json
import os
import pwd
import re
import ssl
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request

RUNNER_USER = "runner"
CA_FILE = "/usr/local/share/ca-certificates/garm-ca-bundle.crt"


def log(msg):
    print("lve-garm-bootstrap: " + msg, flush=True)


class Garm:
    def __init__(self, cfg):
        self.cfg = cfg
        self.token = cfg["token"]
        cb = cfg["callback_url"].rstrip("/")
        self.status_url = cb if cb.endswith("/status") else cb + "/status"
        self.info_url = self.status_url[: -len("/status")] + "/system-info/"
        self.meta = cfg["metadata_url"].rstrip("/")
        self.ctx = ssl.create_default_context()
        if cfg.get("ca_bundle"):
            self.ctx.load_verify_locations(CA_FILE)

    def request(self, method, url, body=None, token=None, tries=30):
        data = None if body is None else json.dumps(body).encode()
        last = None
        for _ in range(tries):
            req = urllib.request.Request(url, data=data, method=method)
            req.add_header("Accept", "application/json")
            if data is not None:
                req.add_header("Content-Type", "application/json")
            if token:
                req.add_header("Authorization", "Bearer " + token)
            try:
                with urllib.request.urlopen(req, timeout=30, context=self.ctx) as resp:
                    return resp.read()
            except urllib.error.HTTPError as e:
                if e.code < 500:
                    raise RuntimeError("%s %s: HTTP %d" % (method, url, e.code))
                last = e
            except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
                last = e
            time.sleep(2)
        raise RuntimeError("%s %s: %s" % (method, url, last))

    def status(self, status, message, agent_id=None):
        body = {"status": status, "message": message}
        if agent_id is not None:
            body["agent_id"] = agent_id
        self.request("POST", self.status_url, body, self.token)

    def metadata(self, path):
        return self.request("GET", self.meta + "/" + path, None, self.token)


def runner_home():
    try:
        return pwd.getpwnam(RUNNER_USER).pw_dir
    except KeyError:
        subprocess.run(["useradd", "-m", "-s", "/bin/bash", RUNNER_USER], check=True)
        return pwd.getpwnam(RUNNER_USER).pw_dir


def download(g, tool, dest):
    req = urllib.request.Request(tool["download_url"])
    if tool.get("temp_download_token"):
        req.add_header("Authorization", "Bearer " + tool["temp_download_token"])
    h = hashlib.sha256()
    with urllib.request.urlopen(req, timeout=300, context=g.ctx) as resp, open(dest, "wb") as out:
        while True:
            chunk = resp.read(1 << 20)
            if not chunk:
                break
            h.update(chunk)
            out.write(chunk)
    want = (tool.get("sha256_checksum") or "").lower()
    if h.hexdigest() != want:
        raise RuntimeError("runner download %s: sha256 %s, expected %s" % (tool.get("filename"), h.hexdigest(), want))


def as_runner(args, cwd):
    subprocess.run(["runuser", "-u", RUNNER_USER, "--"] + args, cwd=cwd, check=True)


def main():
    path = sys.argv[1]
    if not os.path.exists(path):
        log("no parameters (a later boot): nothing to do")
        return
    with open(path) as f:
        cfg = json.load(f)
    g = Garm(cfg)
    try:
        if cfg.get("ca_bundle"):
            subprocess.run(["update-ca-certificates"], check=False)
        for k, v in (cfg.get("proxy") or {}).items():
            if v:
                os.environ[k] = v
                os.environ[k.lower()] = v
        g.status("installing", "downloading and installing the runner")
        home = runner_home()
        pw = pwd.getpwnam(RUNNER_USER)
        rdir = os.path.join(home, "actions-runner")
        os.makedirs(rdir, exist_ok=True)
        tool = cfg["tool"]
        tarball = os.path.join(home, "runner-download.tar.gz")
        download(g, tool, tarball)
        with tarfile.open(tarball) as t:
            t.extractall(rdir, filter="data") if hasattr(tarfile, "data_filter") else t.extractall(rdir)
        os.remove(tarball)
        for root, dirs, files in os.walk(rdir):
            for n in dirs + files:
                os.chown(os.path.join(root, n), pw.pw_uid, pw.pw_gid)
        os.chown(rdir, pw.pw_uid, pw.pw_gid)
        g.status("installing", "configuring the runner")
        if cfg.get("jit"):
            for remote, local in (("credentials/runner", ".runner"), ("credentials/credentials", ".credentials"),
                                  ("credentials/credentials_rsaparams", ".credentials_rsaparams")):
                p = os.path.join(rdir, local)
                with open(p, "wb") as f:
                    f.write(g.metadata(remote))
                os.chown(p, pw.pw_uid, pw.pw_gid)
                os.chmod(p, 0o600)
            svc = g.metadata("system/service-name").decode().strip()
            if not re.fullmatch(r"[A-Za-z0-9@._-]{1,200}", svc):
                raise RuntimeError("service name from garm refused: %r" % svc[:80])
            unit = g.metadata("systemd/unit-file?runAsUser=" + RUNNER_USER)
            if not svc.endswith(".service"):
                svc += ".service"
            with open(os.path.join("/etc/systemd/system", svc), "wb") as f:
                f.write(unit)
            subprocess.run(["systemctl", "daemon-reload"], check=True)
            subprocess.run(["systemctl", "enable", "--now", svc], check=True)
        else:
            token = g.metadata("runner-registration-token/").decode().strip()
            args = ["./config.sh", "--unattended", "--url", cfg["repo_url"], "--token", token,
                    "--name", cfg["name"], "--labels", ",".join(cfg.get("labels") or []),
                    "--no-default-labels", "--ephemeral"]
            if cfg.get("runner_group"):
                args += ["--runnergroup", cfg["runner_group"]]
            as_runner(args, rdir)
            subprocess.run(["./svc.sh", "install", RUNNER_USER], cwd=rdir, check=True)
            subprocess.run(["./svc.sh", "start"], cwd=rdir, check=True)
        agent_id = None
        try:
            with open(os.path.join(rdir, ".runner"), "rb") as f:
                agent_id = json.loads(f.read().decode("utf-8-sig")).get("agentId")
        except (OSError, ValueError):
            pass
        osr = {}
        try:
            with open("/etc/os-release") as f:
                for line in f:
                    k, _, v = line.strip().partition("=")
                    osr[k] = v.strip('"')
        except OSError:
            pass
        g.request("POST", g.info_url, {"os_name": osr.get("ID", ""), "os_version": osr.get("VERSION_ID", ""),
                                       "agent_id": agent_id}, g.token)
        g.status("idle", "runner successfully installed", agent_id)
        log("runner installed (agent %s)" % agent_id)
    except Exception as e:  # report any failure to garm, then stop
        log("failed: %s" % e)
        try:
            g.status("failed", str(e)[:1000])
        except Exception as e2:
            log("could not report the failure: %s" % e2)
        sys.exit(1)
    finally:
        try:
            os.remove(path)
        except OSError:
            pass


if __name__ == "__main__":
    main()
